//! GPU health from Xid events: a critical Xid takes the GPU's IDs unhealthy
//! at once; after `quiet` without another one the GPU is healthy again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::manager::Manager;
use crate::nvml::XidEvent;

pub fn spawn(
    mgr: Arc<Manager>,
    mut rx: mpsc::UnboundedReceiver<XidEvent>,
    quiet: Duration,
    cancel: CancellationToken,
) {
    tokio::spawn(async move {
        let mut last: HashMap<usize, Instant> = HashMap::new();
        let tick = (quiet / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
        let mut timer = tokio::time::interval(tick);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                ev = rx.recv() => match ev {
                    None => return,
                    Some(ev) => {
                        tracing::warn!(gpu = ev.gpu, xid = ev.xid, quiet_s = quiet.as_secs_f64(), "GPU unhealthy after a critical Xid");
                        last.insert(ev.gpu, Instant::now());
                        mgr.set_gpu_health(ev.gpu, false);
                    }
                },
                _ = timer.tick() => {
                    let now = Instant::now();
                    last.retain(|&gpu, t| {
                        if now.duration_since(*t) >= quiet {
                            tracing::info!(gpu, "no critical Xid for the quiet period; GPU healthy again");
                            mgr.set_gpu_health(gpu, true);
                            false
                        } else {
                            true
                        }
                    });
                }
            }
        }
    });
}
