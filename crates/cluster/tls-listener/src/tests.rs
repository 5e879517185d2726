use super::*;

/// A self-signed pair for `name`: (certificate PEM, key PEM).
fn pair(name: &str) -> (String, String) {
    let c = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
    (c.cert.pem(), c.signing_key.serialize_pem())
}

/// Writes through a rename, as a rotation does.
fn put(path: &Path, text: &str) {
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn served(r: &Reloading) -> Vec<u8> {
    r.current.read().unwrap().key.cert[0].as_ref().to_vec()
}

/// What `r` serves once it is not `old`, or after 10 s (a loaded machine
/// may run the reload thread late; a fixed sleep of two periods was a
/// guess).
fn served_once_not(r: &Reloading, old: &[&[u8]]) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = served(r);
        if !old.contains(&now.as_slice()) || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// No client connects while a rotation lands; the next handshake catches
/// the one after it half-written (new key, old certificate): it must get
/// the rotated pair, not the first one (which a real run served expired).
#[test]
fn rotations_are_read_without_handshakes_and_a_torn_one_keeps_the_last_good_pair() {
    let dir = tempfile::tempdir().unwrap();
    let files = TlsFiles {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
        client_ca: None,
    };
    let (a, b, c) = (pair("a"), pair("b"), pair("c"));
    put(&files.cert, &a.0);
    put(&files.key, &a.1);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let r = Arc::new(Reloading::new(&files, provider).unwrap());
    refresh_in_background(Arc::downgrade(&r));
    let first = served(&r);
    // mtimes must differ from the first pair's.
    std::thread::sleep(Duration::from_millis(20));
    put(&files.key, &b.1);
    put(&files.cert, &b.0);
    let rotated = served_once_not(&r, &[&first]);
    assert_ne!(
        rotated, first,
        "the rotation was not read without a handshake"
    );
    // Torn: the next key, the current certificate; a handshake now.
    put(&files.key, &c.1);
    std::thread::sleep(RELOAD_CHECK + Duration::from_millis(100));
    r.refresh();
    assert_eq!(
        served(&r),
        rotated,
        "a torn rotation replaced the last good pair"
    );
    // Whole again: read.
    put(&files.cert, &c.0);
    let last = served_once_not(&r, &[&first, &rotated]);
    assert!(
        last != rotated && last != first,
        "the completed rotation was not read"
    );
}
