use super::*;
use loona_hpack::Encoder;

type Fields = Vec<(Vec<u8>, Vec<u8>)>;

fn fields(pairs: &[(&str, &str)]) -> Fields {
    pairs
        .iter()
        .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
}

fn request(authority: &str) -> Fields {
    fields(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/v1beta1.DevicePlugin/ListAndWatch"),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ])
}

fn head(len: usize, kind: u8, flags: u8, stream: u32) -> Vec<u8> {
    let mut v = Vec::new();
    frame_head(len, kind, flags, stream, &mut v);
    v
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = head(payload.len(), kind, flags, stream);
    v.extend_from_slice(payload);
    v
}

fn settings() -> Vec<u8> {
    frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100])
}

/// What h2 would see: the frames, with header blocks reassembled and
/// decoded by a fresh (server-side) decoder.
#[derive(Debug, PartialEq)]
enum Seen {
    Headers {
        stream: u32,
        end_stream: bool,
        fields: Fields,
    },
    Other {
        kind: u8,
        payload: Vec<u8>,
    },
}

fn server_view(bytes: &[u8]) -> Vec<Seen> {
    assert!(bytes.starts_with(PREFACE), "preface forwarded first");
    let mut at = PREFACE.len();
    let mut dec = Decoder::new();
    let mut seen = Vec::new();
    let mut block: Option<(u32, bool, Vec<u8>)> = None;
    while at < bytes.len() {
        let len = usize::from(bytes[at]) << 16
            | usize::from(bytes[at + 1]) << 8
            | usize::from(bytes[at + 2]);
        let (kind, flags) = (bytes[at + 3], bytes[at + 4]);
        let stream = u32::from_be_bytes(bytes[at + 5..at + 9].try_into().unwrap());
        let payload = &bytes[at + 9..at + 9 + len];
        assert!(len <= MAX_FRAME, "frame of {len} bytes");
        at += 9 + len;
        match kind {
            HEADERS => {
                assert_eq!(flags & PADDED, 0);
                let skip = if flags & PRIORITY != 0 { 5 } else { 0 };
                block = Some((stream, flags & END_STREAM != 0, payload[skip..].to_vec()));
            }
            CONTINUATION => block
                .as_mut()
                .expect("continuation after headers")
                .2
                .extend_from_slice(payload),
            _ => seen.push(Seen::Other {
                kind,
                payload: payload.to_vec(),
            }),
        }
        if (kind == HEADERS || kind == CONTINUATION) && flags & END_HEADERS != 0 {
            let (stream, end_stream, b) = block.take().unwrap();
            seen.push(Seen::Headers {
                stream,
                end_stream,
                fields: dec.decode(&b).expect("server decodes"),
            });
        }
    }
    seen
}

fn run(input: &[u8]) -> (Vec<u8>, u64) {
    let mut rw = Rewriter::default();
    let mut out = Vec::new();
    rw.feed(input, &mut out);
    (out, rw.rewritten())
}

fn client_stream(blocks: &[(u32, u8, Fields)]) -> Vec<u8> {
    let mut enc = Encoder::new();
    let mut v = PREFACE.to_vec();
    v.extend(settings());
    for (stream, flags, f) in blocks {
        let b = enc.encode(f.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        v.extend(frame(HEADERS, flags | END_HEADERS, *stream, &b));
        v.extend(frame(0x0, END_STREAM, *stream, b"\0\0\0\0\x05hello"));
    }
    v
}

#[test]
fn socket_path_authority_becomes_localhost_and_the_rest_is_untouched() {
    let input = client_stream(&[(
        1,
        0,
        request("/var/lib/kubelet/device-plugins/vcuda-core.sock"),
    )]);
    let (out, n) = run(&input);
    assert_eq!(n, 1);
    let seen = server_view(&out);
    assert_eq!(
        seen[0],
        Seen::Other {
            kind: 0x4,
            payload: vec![0, 3, 0, 0, 0, 100]
        }
    );
    assert_eq!(
        seen[1],
        Seen::Headers {
            stream: 1,
            end_stream: false,
            fields: request("localhost")
        }
    );
    assert_eq!(
        seen[2],
        Seen::Other {
            kind: 0x0,
            payload: b"\0\0\0\0\x05hello".to_vec()
        }
    );
}

#[test]
fn valid_authorities_are_kept() {
    for a in ["localhost", "vcuda.sock", "127.0.0.1:8080", "[::1]:1"] {
        let (out, n) = run(&client_stream(&[(1, 0, request(a))]));
        assert_eq!(n, 0, "{a}");
        assert_eq!(
            server_view(&out)[1],
            Seen::Headers {
                stream: 1,
                end_stream: false,
                fields: request(a)
            }
        );
    }
    // Empty is not an authority h2 takes.
    let (_, n) = run(&client_stream(&[(1, 0, request(""))]));
    assert_eq!(n, 1);
}

#[test]
fn blocks_indexed_against_the_clients_dynamic_table_stay_consistent() {
    // The client's encoder indexes the first block and refers to its
    // entries in the next ones; the server's table must not need them.
    let blocks: Vec<_> = (0..5u32)
        .map(|i| (2 * i + 1, 0, request("/run/display.sock")))
        .collect();
    let (out, n) = run(&client_stream(&blocks));
    assert_eq!(n, 5);
    let heads: Vec<_> = server_view(&out)
        .into_iter()
        .filter(|s| matches!(s, Seen::Headers { .. }))
        .collect();
    assert_eq!(heads.len(), 5);
    for (i, h) in heads.iter().enumerate() {
        assert_eq!(
            h,
            &Seen::Headers {
                stream: 2 * i as u32 + 1,
                end_stream: false,
                fields: request("localhost")
            }
        );
    }
}

#[test]
fn any_split_of_the_input_gives_the_same_bytes() {
    let input = client_stream(&[
        (1, 0, request("/a.sock")),
        (3, END_STREAM, request("/b.sock")),
    ]);
    let (whole, _) = run(&input);
    for size in [1, 2, 7, 9, 10, 64] {
        let mut rw = Rewriter::default();
        let mut out = Vec::new();
        for c in input.chunks(size) {
            rw.feed(c, &mut out);
        }
        assert_eq!(out, whole, "chunks of {size}");
    }
}

#[test]
fn padding_priority_and_continuations_are_handled() {
    let mut enc = Encoder::new();
    let f = request("/x.sock");
    let b = enc.encode(f.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
    let (one, two) = b.split_at(b.len() / 2);
    let mut payload = vec![3]; // pad length
    payload.extend([0x80, 0, 0, 0, 15]); // exclusive dependency on 0, weight 16
    payload.extend_from_slice(one);
    payload.extend([0, 0, 0]);
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 5, &payload));
    input.extend(frame(CONTINUATION, END_HEADERS, 5, two));
    let (out, n) = run(&input);
    assert_eq!(n, 1);
    // The priority fields survive.
    assert_eq!(out[PREFACE.len() + 4], PRIORITY | END_STREAM | END_HEADERS);
    assert_eq!(
        &out[PREFACE.len() + 9..PREFACE.len() + 14],
        &[0x80, 0, 0, 0, 15]
    );
    assert_eq!(
        server_view(&out),
        vec![Seen::Headers {
            stream: 5,
            end_stream: true,
            fields: request("localhost")
        }]
    );
}

#[test]
fn a_large_block_is_split_into_continuations() {
    let mut f = request("/y.sock");
    f.push((b"x-big".to_vec(), vec![b'a'; 40_000]));
    let mut input = PREFACE.to_vec();
    let b = Encoder::new().encode(f.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
    // The client may send one big frame if the server allowed it.
    input.extend(frame(HEADERS, END_HEADERS, 1, &b));
    let (out, _) = run(&input);
    let mut expect = request("localhost");
    expect.push((b"x-big".to_vec(), vec![b'a'; 40_000]));
    assert_eq!(
        server_view(&out),
        vec![Seen::Headers {
            stream: 1,
            end_stream: false,
            fields: expect
        }]
    );
}

#[test]
fn what_is_not_http2_or_not_decodable_passes_verbatim() {
    let junk = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_eq!(run(junk).0, junk);

    let mut input = PREFACE.to_vec();
    let bad = frame(HEADERS, END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff, 0xff]);
    input.extend(&bad);
    input.extend(settings());
    let (out, n) = run(&input);
    assert_eq!(n, 0);
    let mut expect = PREFACE.to_vec();
    expect.extend(&bad);
    expect.extend(settings());
    assert_eq!(out, expect);
}

#[test]
fn integers_follow_rfc7541() {
    // C.1.2: 1337 with a 5-bit prefix.
    let mut v = Vec::new();
    integer(1337, 5, 0, &mut v);
    assert_eq!(v, [31, 154, 10]);
    let mut v = Vec::new();
    integer(10, 5, 0, &mut v);
    assert_eq!(v, [10]);
    let mut v = Vec::new();
    integer(127, 7, 0, &mut v);
    assert_eq!(v, [127, 0]);
}
