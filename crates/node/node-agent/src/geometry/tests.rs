use super::*;
use std::cell::RefCell;

/// An H100 80GB's GPU-instance profiles (NVIDIA's MIG user guide, "H100
/// MIG Profiles": name, driver id, placements).
fn h100() -> Vec<GiProfile> {
    let p = |name: &str, id, size, starts: &[u32]| GiProfile {
        id,
        name: name.into(),
        placements: starts.iter().map(|&start| Slices { start, size }).collect(),
    };
    vec![
        p("1g.10gb", 19, 1, &[0, 1, 2, 3, 4, 5, 6]),
        p("1g.20gb", 15, 2, &[0, 2, 4, 6]),
        p("2g.20gb", 14, 2, &[0, 2, 4]),
        p("3g.40gb", 9, 4, &[0, 4]),
        p("7g.80gb", 0, 8, &[0]),
    ]
}

/// One GPU in memory: mode, instances; a busy GPU refuses a mode change
/// as NVML does (IN_USE).
#[derive(Default)]
struct Fake {
    on: RefCell<bool>,
    busy_gpu: bool,
    gis: RefCell<Vec<GiState>>,
    calls: RefCell<Vec<String>>,
}

impl MigDriver for Fake {
    fn mode(&self, _: usize) -> Result<(bool, bool), NvmlError> {
        Ok((*self.on.borrow(), *self.on.borrow()))
    }
    fn set_mode(&self, _: usize, on: bool) -> Result<(), NvmlError> {
        if self.busy_gpu {
            return Err(NvmlError::InUse);
        }
        *self.on.borrow_mut() = on;
        Ok(())
    }
    fn profiles(&self, _: usize) -> Result<Vec<GiProfile>, NvmlError> {
        Ok(h100())
    }
    fn instances(&self, _: usize) -> Result<Vec<GiState>, NvmlError> {
        Ok(self.gis.borrow().clone())
    }
    fn create(&self, _: usize, profile: u32, slices: Slices) -> Result<u32, NvmlError> {
        let mut gis = self.gis.borrow_mut();
        let end = |s: Slices| s.start + s.size;
        if gis
            .iter()
            .any(|g| g.slices.start < end(slices) && slices.start < end(g.slices))
        {
            return Err(NvmlError::InsufficientMemory);
        }
        let id = (1..).find(|i| gis.iter().all(|g| g.id != *i)).unwrap();
        gis.push(GiState {
            id,
            profile,
            slices,
            uuids: vec![format!("MIG-{id}")],
            busy: false,
        });
        self.calls
            .borrow_mut()
            .push(format!("create {profile}@{}", slices.start));
        Ok(id)
    }
    fn destroy(&self, _: usize, gi: u32) -> Result<(), NvmlError> {
        self.gis.borrow_mut().retain(|g| g.id != gi);
        self.calls.borrow_mut().push(format!("destroy {gi}"));
        Ok(())
    }
}

const GPU: GpuRef<'static> = GpuRef {
    index: 0,
    uuid: "GPU-a",
};

fn geometry(s: &str) -> Geometry {
    s.parse().unwrap()
}

fn profiles_now(f: &Fake) -> Vec<u32> {
    let mut v: Vec<u32> = f.gis.borrow().iter().map(|g| g.profile).collect();
    v.sort();
    v
}

fn run(f: &Fake, g: &str, held: &[&str], created: &mut Created) -> Result<Outcome, GeometryError> {
    let held = held.iter().map(|s| s.to_string()).collect();
    let mut out = apply(f, &[GPU], &geometry(g), &held, created);
    assert_eq!(out.len(), 1);
    out.pop().unwrap().1
}

#[test]
fn parses_and_refuses_with_the_text() {
    let g = geometry(" 0=3g.40gb, 1g.10gb ;GPU-b=7g.80gb;");
    assert_eq!(g.gpus["0"], ["3g.40gb", "1g.10gb"]);
    assert_eq!(g.gpus["GPU-b"], ["7g.80gb"]);
    for (bad, why) in [
        ("0", "has no '='"),
        ("=1g.10gb", "names no GPU"),
        ("0=", "has no profile"),
        ("0=1g.10gb;0=7g.80gb", "named twice"),
    ] {
        let e = bad.parse::<Geometry>().unwrap_err().to_string();
        assert!(e.contains(why) && e.contains(bad), "{bad}: {e}");
    }
}

#[test]
fn an_empty_gpu_is_partitioned_and_enabled_first() {
    let f = Fake::default();
    let mut c = Created::default();
    let r = run(&f, "0=3g.40gb,1g.10gb,1g.10gb", &[], &mut c).unwrap();
    assert_eq!(
        r,
        Outcome::Applied {
            created: 3,
            destroyed: 0
        }
    );
    assert!(*f.on.borrow());
    assert_eq!(profiles_now(&f), [9, 19, 19]);
    assert_eq!(c.gpus["GPU-a"].len(), 3);
    // Again: nothing to do.
    let again = run(&f, "0=3g.40gb,1g.10gb,1g.10gb", &[], &mut c).unwrap();
    assert_eq!(
        again,
        Outcome::Applied {
            created: 0,
            destroyed: 0
        }
    );
}

#[test]
fn a_busy_gpu_waits_for_its_mode() {
    let f = Fake {
        busy_gpu: true,
        ..Fake::default()
    };
    let e = run(&f, "0=7g.80gb", &[], &mut Created::default()).unwrap_err();
    assert!(e.to_string().contains("enabling MIG mode"), "{e}");
}

#[test]
fn what_others_made_or_use_is_kept() {
    let f = Fake {
        on: RefCell::new(true),
        ..Fake::default()
    };
    // An operator's 3g.40gb at slice 4.
    f.create(0, 9, Slices { start: 4, size: 4 }).unwrap();
    let mut c = Created::default();
    // A 7g.80gb cannot fit beside it: refused, nothing destroyed.
    let e = run(&f, "0=7g.80gb", &[], &mut c).unwrap_err();
    assert!(matches!(e, GeometryError::NoFit { .. }), "{e}");
    assert_eq!(profiles_now(&f), [9]);
    // Two 2g.20gb fit beside it.
    run(&f, "0=2g.20gb,2g.20gb", &[], &mut c).unwrap();
    assert_eq!(profiles_now(&f), [9, 14, 14]);
    // Ours but held by a pod (its MIG UUID): kept; ours and idle: goes.
    let ours: Vec<(u32, String)> = f
        .gis
        .borrow()
        .iter()
        .filter(|g| g.profile == 14)
        .map(|g| (g.id, g.uuids[0].clone()))
        .collect();
    f.calls.borrow_mut().clear();
    let r = run(&f, "0=2g.20gb,1g.10gb,1g.10gb", &[&ours[0].1], &mut c).unwrap();
    assert_eq!(
        r,
        Outcome::Applied {
            created: 2,
            destroyed: 1
        }
    );
    assert_eq!(f.calls.borrow()[0], format!("destroy {}", ours[1].0));
    assert!(f.gis.borrow().iter().any(|g| g.id == ours[0].0));
    assert_eq!(profiles_now(&f), [9, 14, 19, 19]);
    // A process on one of ours: kept too.
    for g in f.gis.borrow_mut().iter_mut() {
        g.busy = g.profile == 19;
    }
    let e = run(&f, "0=7g.80gb", &[], &mut c).unwrap_err();
    assert!(e.to_string().contains("do not fit"), "{e}");
    assert_eq!(profiles_now(&f), [9, 14, 19, 19], "nothing destroyed");
}

#[test]
fn a_profile_the_gpu_lacks_is_named() {
    let f = Fake::default();
    let e = run(&f, "0=1g.5gb", &[], &mut Created::default()).unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("\"1g.5gb\"") && s.contains("1g.10gb, 1g.20gb"),
        "{s}"
    );
    let mut out = apply(
        &f,
        &[GPU],
        &geometry("3=1g.10gb"),
        &BTreeSet::new(),
        &mut Created::default(),
    );
    assert!(matches!(out.pop().unwrap().1, Err(GeometryError::NoGpu(_))));
}

#[test]
fn the_record_forgets_what_is_gone_and_survives_a_bad_file() {
    let f = Fake::default();
    let mut c = Created::default();
    run(&f, "0=3g.40gb", &[], &mut c).unwrap();
    // The operator destroys it and makes a 2g.20gb of their own at the
    // same place (the same id comes back): not vcuda's, so kept when the
    // geometry no longer wants it.
    let id = f.gis.borrow()[0].id;
    f.destroy(0, id).unwrap();
    f.create(0, 14, Slices { start: 0, size: 2 }).unwrap();
    assert_eq!(f.gis.borrow()[0].id, id);
    let r = run(&f, "0=1g.10gb", &[], &mut c).unwrap();
    assert_eq!(
        r,
        Outcome::Applied {
            created: 1,
            destroyed: 0
        }
    );
    assert_eq!(profiles_now(&f), [14, 19]);

    let dir = tempfile::tempdir().unwrap();
    c.store(dir.path()).unwrap();
    assert_eq!(Created::load(dir.path()), c);
    std::fs::write(Created::path(dir.path()), "{not json").unwrap();
    assert_eq!(Created::load(dir.path()), Created::default());
    assert!(dir.path().join("mig-created.json.bad").exists());
}
