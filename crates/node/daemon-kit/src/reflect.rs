//! One reflector task for every watch a daemon keeps (the manager's pods
//! on its node, the extender's nodes and pods): kube-runtime's reflector
//! with its default backoff, driven until cancelled, each event and each
//! failure handed to the caller, who decides what they mean (a change
//! counter, a health state, binding order).

use futures::StreamExt;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event, watcher};
use tokio_util::sync::CancellationToken;

/// Starts watching `api` (filtered by `config`) into a store, on a task
/// that ends when `cancel` is cancelled. `on_event` sees every event after
/// the store has applied it; `on_error` every failure (the watch retries
/// on its own).
pub fn spawn<K>(
    api: Api<K>,
    config: watcher::Config,
    cancel: CancellationToken,
    mut on_event: impl FnMut(&Event<K>) + Send + 'static,
    mut on_error: impl FnMut(&watcher::Error) + Send + 'static,
) -> Store<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, config)).default_backoff();
    tokio::spawn(async move {
        futures::pin_mut!(stream);
        loop {
            let ev = tokio::select! {
                _ = cancel.cancelled() => return,
                ev = stream.next() => ev,
            };
            match ev {
                None => return,
                Some(Ok(ev)) => on_event(&ev),
                Some(Err(e)) => on_error(&e),
            }
        }
    });
    store
}
