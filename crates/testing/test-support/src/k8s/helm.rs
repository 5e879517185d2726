//! Helm as an operator runs it against a real node: the binary
//! tests/run.sh builds (deploy/helm/build-helm.sh, `$VCUDA_HELM_BIN`),
//! helm's own directories under the test's work directory, and a
//! post-renderer that puts a test patch (the local image, the simulated
//! driver's paths, the API server's address) over the chart's objects with
//! kustomize, the way a site patches a chart it does not fork.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The helm binary tests/run.sh built.
pub fn bin() -> PathBuf {
    let dir = std::env::var_os("VCUDA_HELM_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!(
                "VCUDA_HELM_BIN is not set: tests/run.sh builds helm (deploy/helm/build-helm.sh)"
            )
        });
    let helm = dir.join("helm");
    assert!(helm.is_file(), "{} missing", helm.display());
    helm
}

pub struct Helm {
    kubeconfig: PathBuf,
    home: PathBuf,
    post_renderer: PathBuf,
}

impl Helm {
    /// Helm against `kubeconfig`, its directories under `home`; the
    /// post-renderer picks one of `patches` (name, strategic-merge patch
    /// file with its object's apiVersion, kind and name) by the name each
    /// [`Helm::run`] gives, and renders with `kubectl kustomize`.
    pub fn new(kubeconfig: &Path, home: &Path, kubectl: &Path, patches: &[(&str, &Path)]) -> Helm {
        fs::create_dir_all(home).unwrap();
        let cases: String = patches
            .iter()
            .map(|(name, file)| format!("  {name}) cp {} \"$d/patch.yaml\" ;;\n", file.display()))
            .collect();
        let script = home.join("post-render.sh");
        fs::write(
            &script,
            format!(
                "#!/bin/sh
set -e
d=$(mktemp -d)
trap 'rm -rf \"$d\"' EXIT
cat >\"$d/all.yaml\"
case \"$VCUDA_TEST_PATCH\" in
{cases}  *) echo \"VCUDA_TEST_PATCH=$VCUDA_TEST_PATCH: not one of this test's patches\" >&2; exit 1 ;;
esac
printf 'resources:\\n- all.yaml\\npatchesStrategicMerge:\\n- patch.yaml\\n' >\"$d/kustomization.yaml\"
{kubectl} kustomize \"$d\"
",
                kubectl = kubectl.display(),
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        Helm {
            kubeconfig: kubeconfig.to_path_buf(),
            home: home.to_path_buf(),
            post_renderer: script,
        }
    }

    /// The post-renderer script, for `--post-renderer`.
    pub fn post_renderer(&self) -> &str {
        self.post_renderer.to_str().unwrap()
    }

    /// `helm <args> -n kube-system` with the test patch `patch`; panics
    /// with helm's output when it fails.
    pub fn run(&self, patch: &str, args: &[&str]) -> String {
        let out = Command::new(bin())
            .args(args)
            .args(["-n", "kube-system", "--kubeconfig"])
            .arg(&self.kubeconfig)
            .env("VCUDA_TEST_PATCH", patch)
            .env("HELM_CACHE_HOME", self.home.join("cache"))
            .env("HELM_CONFIG_HOME", self.home.join("config"))
            .env("HELM_DATA_HOME", self.home.join("data"))
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "helm {args:?}:\n{text}");
        text
    }
}
