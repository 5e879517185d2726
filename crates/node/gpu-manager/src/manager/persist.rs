//! Durability by group commit: every change bumps `State::version`;
//! [`Manager::persist`] writes a snapshot of the allocations (one
//! checkpoint write and one sync, on a blocking thread, outside the state
//! lock) and so covers every change made before it. Changes that need no
//! sync of their own (releases, vcuda-memory IDs, the verified flag: a
//! checkpoint that over-states is corrected by recovery) ride along with
//! the next Allocate's write, the lazy flush or the periodic check's. An
//! Allocate answers only once a write that includes it is durable.

use std::sync::Arc;
use std::time::Duration;

use super::refusal::Refusal;

use super::Manager;
use super::state::State;
use crate::world::checkpoint::CheckpointError;

/// Changes without a sync of their own are written once no Allocate has
/// come for this long (an Allocate's write covers them anyway), so that
/// the background write rarely makes an Allocate wait.
const LAZY_FLUSH_IDLE: Duration = Duration::from_millis(200);

impl Manager {
    /// Makes the allocations durable up to `want` (a `State::changed`
    /// version): returns at once when a write already covered it, else
    /// waits for the write in progress and, if that did not cover it
    /// either, writes a snapshot itself. On failure the previous
    /// checkpoint stays intact and the error is reported; the next write
    /// (change or periodic check) tries again.
    pub async fn persist(&self, want: u64) -> Result<(), Refusal> {
        if self.st().durable >= want {
            return Ok(());
        }
        if let Err(e) = self.health() {
            return Err(Refusal::unavailable(format!(
                "not recording the allocation: {e}"
            )));
        }
        let _writer = self.commit_lock.lock().await;
        let (version, allocs) = {
            let st = self.st();
            if st.durable >= want {
                return Ok(());
            }
            (st.version, st.allocs.values().cloned().collect::<Vec<_>>())
        };
        let (cp, uuids) = (self.checkpoint.clone(), self.uuids());
        let location = self.checkpoint.location();
        let r = tokio::task::spawn_blocking(move || cp.store(&uuids, &allocs))
            .await
            .unwrap_or_else(|e| {
                Err(CheckpointError::Io {
                    path: location.clone(),
                    source: std::io::Error::other(e.to_string()),
                })
            });
        let mut st = self.st();
        match r {
            Ok(()) => {
                st.durable = st.durable.max(version);
                if std::mem::take(&mut st.write_failed) {
                    tracing::info!(path = %location, "checkpoint written again");
                }
                Ok(())
            }
            Err(e) => {
                st.write_failed = true;
                tracing::error!(
                    error = %e,
                    "writing the allocation checkpoint failed; the previous one is intact (disk full or read-only?); retrying at the next change"
                );
                Err(Refusal::internal(format!(
                    "recording the allocation durably failed ({e}); the previous checkpoint is intact; free space or make {location} writable"
                )))
            }
        }
    }

    /// A change that needs no sync of its own (a release, vcuda-memory
    /// IDs, the verified flag): written with the next Allocate's write, or
    /// by the lazy flush after a pause.
    pub(super) fn changed_lazily(&self, st: &mut State) {
        st.changed();
        self.lazy.notify_one();
    }

    /// Writes lazy changes in the background once Allocate calls pause
    /// for [`LAZY_FLUSH_IDLE`] (also done by the periodic check and at
    /// shutdown), until `cancel`.
    pub fn spawn_lazy_flush(self: &Arc<Self>, cancel: tokio_util::sync::CancellationToken) {
        let mgr = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = mgr.lazy.notified() => {}
                }
                loop {
                    let quiet = {
                        let st = mgr.st();
                        if st.durable >= st.version {
                            break;
                        }
                        LAZY_FLUSH_IDLE.saturating_sub(st.last_allocate.elapsed())
                    };
                    if quiet.is_zero() {
                        let _ = mgr.flush().await;
                        break;
                    }
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(quiet) => {}
                    }
                }
            }
        });
    }

    /// Writes whatever changed since the last write (periodic check,
    /// shutdown); errors are logged by [`Manager::persist`].
    pub async fn flush(&self) -> Result<(), Refusal> {
        let want = self.st().version;
        self.persist(want).await
    }

    /// Whether the checkpoint is behind memory (changes waiting for the
    /// next write, or a write failed).
    pub fn checkpoint_dirty(&self) -> bool {
        let st = self.st();
        st.durable < st.version
    }
}
