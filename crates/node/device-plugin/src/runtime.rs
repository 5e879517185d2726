//! Serves plugins on unix sockets, registers them with kubelet and keeps them
//! registered across kubelet restarts.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use notify::Watcher;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use vcuda_api::deviceplugin::v1beta1::{
    KUBELET_SOCKET, RegisterRequest, VERSION, device_plugin_server::DevicePluginServer,
    registration_client::RegistrationClient,
};

use crate::grpc::GrpcPlugin;
use crate::service::DevicePluginService;
use crate::{Error, connect_unix};

/// Timing knobs. The defaults suit production and tests alike.
#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    /// First retry delay after a failed registration.
    pub backoff_initial: Duration,
    /// Cap of the doubling retry delay (kubelet may be down for long).
    pub backoff_max: Duration,
    /// Backstop poll of the sockets, in case an inotify event is lost (or the
    /// watch could not be set up, e.g. on some overlay file systems).
    pub check_interval: Duration,
    /// Timeout of connecting to kubelet and of the Register call.
    pub rpc_timeout: Duration,
    /// How long a stopping server may drain before its task is aborted.
    pub drain_timeout: Duration,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        Self {
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            check_interval: Duration::from_secs(1),
            rpc_timeout: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(2),
        }
    }
}

/// What a plugin task reports about itself, for health checks and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginStatus {
    /// Registered with the kubelet whose socket is there now.
    pub registered: bool,
    /// Successful registrations so far (1 + kubelet restarts seen).
    pub registrations: u64,
    /// Times the plugin socket was (re)bound.
    pub binds: u64,
    /// Why the last registration attempt failed, if it did.
    pub last_error: Option<String>,
}

struct PluginEntry {
    resource: String,
    socket_name: String,
    plugin: Arc<dyn DevicePluginService>,
}

/// Runs any number of device plugins in one process, each on its own socket
/// in the device-plugin dir.
///
/// ```no_run
/// # use std::sync::Arc;
/// # async fn demo(vcore: Arc<dyn device_plugin::DevicePluginService>) -> Result<(), device_plugin::Error> {
/// let cancel = device_plugin::CancellationToken::new();
/// let handle = device_plugin::PluginRuntime::new("/var/lib/kubelet/device-plugins")
///     .plugin("tencent.com/vcuda-core", "vcore.sock", vcore)
///     .start(cancel)?;
/// handle.wait().await
/// # }
/// ```
pub struct PluginRuntime {
    dir: PathBuf,
    opts: RuntimeOptions,
    plugins: Vec<PluginEntry>,
}

impl PluginRuntime {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            opts: RuntimeOptions::default(),
            plugins: Vec::new(),
        }
    }

    pub fn options(mut self, opts: RuntimeOptions) -> Self {
        self.opts = opts;
        self
    }

    /// Adds a plugin for `resource` (e.g. `tencent.com/vcuda-core`) served on
    /// `<dir>/<socket_name>`.
    pub fn plugin(
        mut self,
        resource: impl Into<String>,
        socket_name: impl Into<String>,
        plugin: Arc<dyn DevicePluginService>,
    ) -> Self {
        self.plugins.push(PluginEntry {
            resource: resource.into(),
            socket_name: socket_name.into(),
            plugin,
        });
        self
    }

    fn check(&self) -> Result<(), Error> {
        if self.plugins.is_empty() {
            return Err(Error::Config("no plugin added".into()));
        }
        let mut names = std::collections::HashSet::new();
        for p in &self.plugins {
            let n = &p.socket_name;
            if n.is_empty() || n.contains('/') || n == KUBELET_SOCKET || !names.insert(n.clone()) {
                return Err(Error::Config(format!(
                    "socket name {n:?} of {} must be a unique plain file name other than {KUBELET_SOCKET}",
                    p.resource
                )));
            }
            // kubelet wants an extended resource name: <domain>/<name>.
            if p.resource.split('/').count() != 2 || p.resource.split('/').any(str::is_empty) {
                return Err(Error::Config(format!(
                    "resource name {:?} must look like domain/name",
                    p.resource
                )));
            }
        }
        Ok(())
    }

    /// Binds every socket and starts registering; returns at once. Cancelling
    /// `cancel` stops serving and removes the sockets; await
    /// [`RuntimeHandle::wait`] for that to finish.
    pub fn start(self, cancel: CancellationToken) -> Result<RuntimeHandle, Error> {
        self.check()?;
        let events = watch::Sender::new(0u64);
        let again = watch::Sender::new(0u64);
        let connections = Connections::default();
        let watcher = watch_dir(&self.dir, events.clone());
        if let Err(e) = &watcher {
            tracing::warn!(error = %e, "no inotify watch; relying on the periodic socket check");
        }
        let mut tasks = Vec::new();
        let mut status = HashMap::new();
        for entry in self.plugins {
            let (tx, rx) = watch::channel(PluginStatus::default());
            status.insert(entry.resource.clone(), rx);
            let task = PluginTask {
                sock: self.dir.join(&entry.socket_name),
                kubelet_sock: self.dir.join(KUBELET_SOCKET),
                entry,
                opts: self.opts.clone(),
                status: tx,
                connections: connections.clone(),
            };
            tasks.push(tokio::spawn(task.run(
                events.subscribe(),
                again.subscribe(),
                cancel.clone(),
            )));
        }
        // The watcher lives until shutdown.
        let keep = cancel.clone();
        tokio::spawn(async move {
            keep.cancelled().await;
            drop(watcher);
            drop(events);
        });
        Ok(RuntimeHandle {
            tasks,
            status,
            again,
            connections,
            cancel,
        })
    }
}

/// Handle on started plugins.
pub struct RuntimeHandle {
    tasks: Vec<JoinHandle<()>>,
    status: HashMap<String, watch::Receiver<PluginStatus>>,
    again: watch::Sender<u64>,
    connections: Connections,
    cancel: CancellationToken,
}

/// Copies of the connections kubelet opened to the plugin sockets.
#[derive(Clone, Default)]
struct Connections(Arc<std::sync::Mutex<Vec<std::os::fd::OwnedFd>>>);

impl Connections {
    fn keep(&self, s: &tokio::net::UnixStream) {
        use std::os::fd::AsFd;
        if let Ok(fd) = s.as_fd().try_clone_to_owned() {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).push(fd);
        }
    }

    /// Copies of those whose peer has not closed them; drops the others.
    fn open(&self) -> Vec<std::os::fd::OwnedFd> {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        v.retain(peer_open);
        v.iter().filter_map(|fd| fd.try_clone().ok()).collect()
    }
}

/// Whether the other end of a connected socket is still there (reading it
/// would not give end-of-file); nothing is consumed.
fn peer_open(fd: &std::os::fd::OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    // SAFETY: a peek of one byte into a local buffer, on an fd we own.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            b.as_mut_ptr() as *mut libc::c_void,
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n != 0
}

impl RuntimeHandle {
    /// Status channel of the plugin for `resource`.
    pub fn status(&self, resource: &str) -> Option<watch::Receiver<PluginStatus>> {
        self.status.get(resource).cloned()
    }

    /// The status channels of every plugin, to wait on without the handle.
    pub fn statuses(&self) -> Vec<watch::Receiver<PluginStatus>> {
        self.status.values().cloned().collect()
    }

    /// Registers every plugin with kubelet again, now: kubelet then calls
    /// this process rather than one that registered the same resources
    /// later (and has gone).
    pub fn register_again(&self) {
        self.again.send_modify(|n| *n += 1);
    }

    /// Copies of the connections kubelet has open to the plugin sockets. A
    /// process replaced by another hands them to it: while a copy is open,
    /// kubelet's `ListAndWatch` stream on it does not end when this process
    /// does, and kubelet ≥ 1.26 does not drop the newer registration.
    pub fn kubelet_connections(&self) -> Vec<std::os::fd::OwnedFd> {
        self.connections.open()
    }

    /// Stops serving (same as cancelling the token given to `start`).
    pub fn shutdown(&self) {
        self.cancel.cancel();
    }

    /// Waits until every plugin has stopped and removed its socket.
    pub async fn wait(self) -> Result<(), Error> {
        for t in self.tasks {
            t.await.map_err(|e| Error::Task {
                resource: "?".into(),
                reason: e.to_string(),
            })?;
        }
        Ok(())
    }
}

/// Waits until every plugin of `statuses` is registered with the kubelet
/// there now; false if a plugin stopped first.
pub async fn all_registered(statuses: Vec<watch::Receiver<PluginStatus>>) -> bool {
    for mut st in statuses {
        if st.wait_for(|s| s.registered).await.is_err() {
            return false;
        }
    }
    true
}

fn watch_dir(dir: &Path, events: watch::Sender<u64>) -> Result<notify::RecommendedWatcher, Error> {
    let err = |source| Error::Watch {
        path: dir.to_path_buf(),
        source,
    };
    let mut w = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if res.is_ok() {
            events.send_modify(|n| *n += 1);
        }
    })
    .map_err(err)?;
    w.watch(dir, notify::RecursiveMode::NonRecursive)
        .map_err(err)?;
    Ok(w)
}

/// Identity of a file: a re-created socket has a new inode (and ctime).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileId(u64, u64, i64, i64);

fn file_id(p: &Path) -> Option<FileId> {
    std::fs::symlink_metadata(p)
        .ok()
        .map(|m| FileId(m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

struct Server {
    id: FileId,
    stop: CancellationToken,
    join: JoinHandle<Result<(), tonic::transport::Error>>,
    /// Changes when the kubelet closes one of this server's streams.
    closed_by_kubelet: watch::Receiver<u64>,
}

/// How long after the kubelet dropped our registration we register again:
/// long enough for its own disconnect to finish (so the new registration
/// is not the one it drops), short next to its pod admissions.
const REREGISTER_DELAY: Duration = Duration::from_millis(20);

struct PluginTask {
    entry: PluginEntry,
    sock: PathBuf,
    kubelet_sock: PathBuf,
    opts: RuntimeOptions,
    status: watch::Sender<PluginStatus>,
    connections: Connections,
}

/// Where a plugin stands with kubelet's registration.
struct Reg {
    /// The kubelet.sock we registered with.
    with: Option<FileId>,
    backoff: Duration,
    retry_at: Option<Instant>,
    /// kubelet.sock identity at the last failed attempt: a new one retries at once.
    failed_with: Option<Option<FileId>>,
    /// The delay before registering again after kubelet dropped us;
    /// doubles while it keeps doing so within a second.
    kick_delay: Duration,
    last_kick: Option<Instant>,
}

impl Reg {
    fn new(opts: &RuntimeOptions) -> Reg {
        Reg {
            with: None,
            backoff: opts.backoff_initial,
            retry_at: None,
            failed_with: None,
            kick_delay: REREGISTER_DELAY,
            last_kick: None,
        }
    }

    /// Whether to register with the kubelet whose socket is `kubelet` now.
    fn due(&self, kubelet: Option<FileId>) -> bool {
        (kubelet.is_none() || kubelet != self.with)
            && (self.retry_at.is_none_or(|t| Instant::now() >= t)
                || self.failed_with != Some(kubelet))
    }

    /// How long the loop may sleep before the next retry is due.
    fn wait(&self, check: Duration) -> Duration {
        match self.retry_at.filter(|_| self.with.is_none()) {
            Some(t) => check.min(t.saturating_duration_since(Instant::now())),
            None => check,
        }
    }

    /// Kubelet dropped the registration: again after `kick_delay`.
    fn kicked(&mut self, kubelet: Option<FileId>, max: Duration) -> Duration {
        self.kick_delay = match self.last_kick {
            Some(t) if t.elapsed() < Duration::from_secs(1) => (self.kick_delay * 2).min(max),
            _ => REREGISTER_DELAY,
        };
        self.last_kick = Some(Instant::now());
        self.with = None;
        self.retry_at = Some(Instant::now() + self.kick_delay);
        self.failed_with = Some(kubelet);
        self.kick_delay
    }

    /// Register again now.
    fn again(&mut self) {
        self.with = None;
        self.retry_at = None;
        self.failed_with = None;
    }
}

impl PluginTask {
    async fn run(
        self,
        mut events: watch::Receiver<u64>,
        mut again: watch::Receiver<u64>,
        cancel: CancellationToken,
    ) {
        let res = &self.entry.resource;
        let mut server: Option<Server> = None;
        let mut reg = Reg::new(&self.opts);
        while !cancel.is_cancelled() {
            // 1. Our socket: kubelet deletes it when it starts.
            let ours = file_id(&self.sock);
            let alive = server
                .as_ref()
                .is_some_and(|s| Some(s.id) == ours && !s.join.is_finished());
            if !alive {
                if let Some(s) = server.take() {
                    tracing::info!(resource = %res, socket = %self.sock.display(), "plugin socket gone (kubelet restart?); re-binding");
                    self.stop_server(s).await;
                }
                reg.with = None;
                match self.bind() {
                    Ok(s) => {
                        server = Some(s);
                        self.status.send_modify(|st| {
                            st.binds += 1;
                            st.registered = false;
                        });
                    }
                    Err(e) => {
                        let backoff = reg.backoff;
                        tracing::error!(resource = %res, error = %e, "cannot serve; retrying in {backoff:?}");
                        tokio::select! {
                            () = tokio::time::sleep(backoff) => {}
                            () = cancel.cancelled() => break,
                        }
                        reg.backoff = (backoff * 2).min(self.opts.backoff_max);
                        continue;
                    }
                }
            }

            // 2. Registration with the kubelet that is there now.
            let kubelet = file_id(&self.kubelet_sock);
            if reg.due(kubelet) {
                self.try_register(&mut reg, kubelet).await;
            }

            // 3. Sleep until a file-system event, the next retry, kubelet
            // dropping us, a request to register again, or the backstop check.
            let wait = reg.wait(self.opts.check_interval);
            let kicked = async {
                match server.as_mut() {
                    Some(s) => s.closed_by_kubelet.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = cancel.cancelled() => break,
                r = events.changed() => if r.is_err() {
                    // Watcher gone (shutdown in progress): fall back to polling.
                    tokio::time::sleep(wait).await;
                },
                true = kicked => {
                    let again_in = reg.kicked(file_id(&self.kubelet_sock), self.opts.backoff_max);
                    tracing::info!(resource = %res, ?again_in, "kubelet dropped this registration (a replaced instance stopped?); registering again");
                    self.status.send_modify(|st| st.registered = false);
                },
                Ok(()) = again.changed() => {
                    tracing::info!(resource = %res, "registering again, as asked");
                    reg.again();
                },
                () = tokio::time::sleep(wait) => {}
            }
        }
        if let Some(s) = server.take() {
            self.stop_server(s).await;
        }
        self.status.send_modify(|st| st.registered = false);
        tracing::info!(resource = %res, "plugin stopped");
    }

    /// One registration attempt; its outcome recorded in `reg` and the status.
    async fn try_register(&self, reg: &mut Reg, kubelet: Option<FileId>) {
        let res = &self.entry.resource;
        match self.register(kubelet.is_some()).await {
            Ok(()) => {
                reg.with = kubelet;
                reg.backoff = self.opts.backoff_initial;
                reg.retry_at = None;
                reg.failed_with = None;
                self.status.send_modify(|st| {
                    st.registered = true;
                    st.registrations += 1;
                    st.last_error = None;
                });
                tracing::info!(resource = %res, socket = %self.sock.display(), "registered with kubelet");
            }
            Err(e) => {
                let backoff = reg.backoff;
                tracing::warn!(resource = %res, error = %e, retry_in = ?backoff, "registration failed");
                reg.with = None;
                reg.retry_at = Some(Instant::now() + backoff);
                reg.failed_with = Some(kubelet);
                reg.backoff = (backoff * 2).min(self.opts.backoff_max);
                self.status.send_modify(|st| {
                    st.registered = false;
                    st.last_error = Some(e.to_string());
                });
            }
        }
    }

    fn bind(&self) -> Result<Server, Error> {
        let err = |source| Error::Bind {
            path: self.sock.clone(),
            source,
        };
        // A stale socket file from an earlier run makes bind fail with EADDRINUSE.
        match std::fs::remove_file(&self.sock) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
            _ => {}
        }
        let listener = UnixListener::bind(&self.sock).map_err(err)?;
        let id = file_id(&self.sock)
            .ok_or_else(|| err(std::io::Error::other("socket vanished right after bind")))?;
        let stop = CancellationToken::new();
        let closed_by_kubelet = watch::Sender::new(0u64);
        let svc = DevicePluginServer::new(GrpcPlugin {
            resource: self.entry.resource.clone(),
            plugin: self.entry.plugin.clone(),
            stop: stop.clone(),
            closed_by_kubelet: closed_by_kubelet.clone(),
        });
        let shutdown = stop.clone().cancelled_owned();
        let connections = self.connections.clone();
        let incoming = tokio_stream::StreamExt::map(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            move |c| {
                c.map(|s| {
                    connections.keep(&s);
                    uds_authority::Fixed::new(s)
                })
            },
        );
        let join = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, shutdown),
        );
        tracing::debug!(resource = %self.entry.resource, socket = %self.sock.display(), "serving");
        Ok(Server {
            id,
            stop,
            join,
            closed_by_kubelet: closed_by_kubelet.subscribe(),
        })
    }

    async fn stop_server(&self, s: Server) {
        s.stop.cancel();
        let mut join = s.join;
        match tokio::time::timeout(self.opts.drain_timeout, &mut join).await {
            Ok(Ok(Err(e))) => {
                tracing::warn!(resource = %self.entry.resource, error = %e, "server ended with error")
            }
            Ok(_) => {}
            Err(_) => {
                tracing::warn!(resource = %self.entry.resource, "server did not drain in time; aborting it");
                join.abort();
            }
        }
        // Remove the socket only if it is still the one we bound.
        if file_id(&self.sock)
            .is_some_and(|id| FileId(id.0, id.1, 0, 0) == FileId(s.id.0, s.id.1, 0, 0))
        {
            let _ = std::fs::remove_file(&self.sock);
        }
    }

    async fn register(&self, kubelet_present: bool) -> Result<(), Error> {
        let path = &self.kubelet_sock;
        let resource = &self.entry.resource;
        if !kubelet_present {
            return Err(Error::Register {
                resource: resource.clone(),
                path: path.clone(),
                code: tonic::Code::Unavailable,
                message: "socket does not exist (kubelet not running?)".into(),
            });
        }
        let ch = connect_unix(path, self.opts.rpc_timeout).await?;
        let mut client = RegistrationClient::new(ch);
        let mut req = tonic::Request::new(RegisterRequest {
            version: VERSION.to_string(),
            endpoint: self.entry.socket_name.clone(),
            resource_name: resource.clone(),
            options: Some(self.entry.plugin.options()),
        });
        req.set_timeout(self.opts.rpc_timeout);
        client
            .register(req)
            .await
            .map(|_| ())
            .map_err(|s| Error::Register {
                resource: resource.clone(),
                path: path.clone(),
                code: s.code(),
                message: s.message().to_string(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::DeviceList;
    use tokio::sync::mpsc;
    use vcuda_api::deviceplugin::v1beta1::{
        AllocateRequest, AllocateResponse, Device, DevicePluginOptions, Empty,
        registration_server::{Registration, RegistrationServer},
    };

    struct Nop(DeviceList);

    #[tonic::async_trait]
    impl DevicePluginService for Nop {
        fn options(&self) -> DevicePluginOptions {
            DevicePluginOptions {
                pre_start_required: true,
                get_preferred_allocation_available: false,
            }
        }
        fn devices(&self) -> watch::Receiver<Vec<Device>> {
            self.0.subscribe()
        }
        async fn allocate(&self, _r: AllocateRequest) -> Result<AllocateResponse, tonic::Status> {
            Ok(AllocateResponse::default())
        }
    }

    /// A kubelet that only records Register calls.
    struct Recorder(mpsc::UnboundedSender<RegisterRequest>);

    #[tonic::async_trait]
    impl Registration for Recorder {
        async fn register(
            &self,
            r: tonic::Request<RegisterRequest>,
        ) -> Result<tonic::Response<Empty>, tonic::Status> {
            self.0.send(r.into_inner()).unwrap();
            Ok(tonic::Response::new(Empty {}))
        }
    }

    fn nop() -> Arc<dyn DevicePluginService> {
        Arc::new(Nop(DeviceList::healthy(["a"])))
    }

    #[test]
    fn bad_configuration_is_refused() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let _g = rt.enter();
        let start = |r: PluginRuntime| {
            r.start(CancellationToken::new())
                .err()
                .map(|e| e.to_string())
        };
        assert!(
            start(PluginRuntime::new("/tmp"))
                .unwrap()
                .contains("no plugin")
        );
        let dup = PluginRuntime::new("/tmp")
            .plugin("a.com/x", "x.sock", nop())
            .plugin("a.com/y", "x.sock", nop());
        assert!(start(dup).unwrap().contains("\"x.sock\""));
        let kubelet = PluginRuntime::new("/tmp").plugin("a.com/x", "kubelet.sock", nop());
        assert!(start(kubelet).unwrap().contains("kubelet.sock"));
        let name = PluginRuntime::new("/tmp").plugin("nodomain", "x.sock", nop());
        assert!(start(name).unwrap().contains("domain/name"));
    }

    #[test]
    fn dropped_registrations_retry_soon_and_back_off_when_repeated() {
        let opts = RuntimeOptions::default();
        let mut reg = Reg::new(&opts);
        let kubelet = Some(FileId(1, 2, 3, 4));
        reg.with = kubelet;
        assert!(!reg.due(kubelet), "registered with this kubelet");
        assert_eq!(reg.kicked(kubelet, opts.backoff_max), REREGISTER_DELAY);
        assert!(!reg.due(kubelet), "not before the delay");
        assert!(reg.wait(opts.check_interval) <= REREGISTER_DELAY);
        std::thread::sleep(REREGISTER_DELAY);
        assert!(reg.due(kubelet));
        // Dropped again at once (a loop with kubelet): the delay doubles.
        assert_eq!(reg.kicked(kubelet, opts.backoff_max), 2 * REREGISTER_DELAY);
        assert_eq!(reg.kicked(kubelet, opts.backoff_max), 4 * REREGISTER_DELAY);
        reg.again();
        assert!(reg.due(kubelet), "asked to register again: now");
    }

    #[tokio::test]
    async fn registers_with_kubelet_fields_and_again_after_kubelet_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let serve_kubelet = |tx: mpsc::UnboundedSender<RegisterRequest>| {
            let l = UnixListener::bind(dir.path().join(KUBELET_SOCKET)).unwrap();
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(RegistrationServer::new(Recorder(tx)))
                    .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(l)),
            )
        };
        let k1 = serve_kubelet(tx.clone());
        let cancel = CancellationToken::new();
        let h = PluginRuntime::new(dir.path())
            .plugin("example.com/x", "x.sock", nop())
            .start(cancel.clone())
            .unwrap();
        let req = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(req.version, "v1beta1");
        assert_eq!(req.endpoint, "x.sock");
        assert_eq!(req.resource_name, "example.com/x");
        assert!(req.options.unwrap().pre_start_required);

        // A new kubelet.sock (new inode) alone triggers re-registration.
        k1.abort();
        std::fs::remove_file(dir.path().join(KUBELET_SOCKET)).unwrap();
        let _k2 = serve_kubelet(tx);
        let again = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(again.endpoint, "x.sock");
        let st = h.status("example.com/x").unwrap();
        let st = tokio::time::timeout(Duration::from_secs(5), async {
            let mut st = st;
            st.wait_for(|s| s.registrations == 2).await.unwrap().clone()
        })
        .await
        .unwrap();
        assert_eq!(st.binds, 1, "our socket was not deleted, so no re-bind");

        cancel.cancel();
        h.wait().await.unwrap();
        assert!(!dir.path().join("x.sock").exists());
    }
}
