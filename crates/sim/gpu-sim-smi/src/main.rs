//! `nvidia-smi` for the simulated node: an NVML client like the real one,
//! so what it prints is what NVML reports.
//!
//! Supports the default table, `-L`, `-i ID[,ID]`, `--query-gpu=...` and
//! `--query-compute-apps=...` with `--format=csv[,noheader][,nounits]`, and
//! `mig -lgip`.

mod mig;

use nvml_wrapper::enum_wrappers::device::{
    Clock, ComputeMode, PerformanceState, TemperatureSensor,
};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use std::fmt::Write as _;
use std::process::ExitCode;

const MIB: u64 = 1024 * 1024;
const DRIVER_FAILURE: &str = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. \
Make sure that the latest NVIDIA driver is installed and running.";

struct Args {
    list: bool,
    /// `mig -lgip`.
    mig_lgip: bool,
    ids: Option<Vec<String>>,
    query_gpu: Option<Vec<String>>,
    query_apps: Option<Vec<String>>,
    header: bool,
    units: bool,
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: nvidia-smi [-L] [-i ID[,ID...]] [--query-gpu=FIELDS | --query-compute-apps=FIELDS] \
         [--format=csv[,noheader][,nounits]] | nvidia-smi mig -lgip"
    );
    ExitCode::from(2)
}

fn parse_args() -> Result<Args, ExitCode> {
    let mut a = Args {
        list: false,
        mig_lgip: false,
        ids: None,
        query_gpu: None,
        query_apps: None,
        header: true,
        units: true,
    };
    let mut csv = false;
    let mut it = std::env::args().skip(1);
    let split = |s: &str| {
        s.split(',')
            .map(|f| f.trim().to_string())
            .collect::<Vec<_>>()
    };
    while let Some(arg) = it.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        let value = |it: &mut dyn Iterator<Item = String>| inline.clone().or_else(|| it.next());
        match key.as_str() {
            "-L" | "--list-gpus" => a.list = true,
            "mig" => match it.next().as_deref() {
                Some("-lgip" | "--list-gpu-instance-profiles") => a.mig_lgip = true,
                _ => return Err(usage()),
            },
            "-i" | "--id" => a.ids = Some(split(&value(&mut it).ok_or_else(usage)?)),
            "--query-gpu" => a.query_gpu = Some(split(&value(&mut it).ok_or_else(usage)?)),
            "--query-compute-apps" => {
                a.query_apps = Some(split(&value(&mut it).ok_or_else(usage)?))
            }
            "--format" => {
                for f in split(&value(&mut it).ok_or_else(usage)?) {
                    match f.as_str() {
                        "csv" => csv = true,
                        "noheader" => a.header = false,
                        "nounits" => a.units = false,
                        _ => return Err(usage()),
                    }
                }
            }
            "-h" | "--help" => {
                usage();
                return Err(ExitCode::SUCCESS);
            }
            _ => {
                eprintln!(
                    "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
                );
                return Err(ExitCode::from(2));
            }
        }
    }
    if (a.query_gpu.is_some() || a.query_apps.is_some()) && !csv {
        eprintln!("'--format' argument is required for query options (e.g. --format=csv).");
        return Err(ExitCode::from(2));
    }
    Ok(a)
}

/// Loads NVML the way the real tool does (the dynamic loader's search:
/// LD_LIBRARY_PATH, ld.so.cache), then next to this binary's root, where
/// `gpu-sim install` puts it.
fn load() -> Result<Nvml, NvmlError> {
    match Nvml::init() {
        Err(NvmlError::LibloadingError(e)) => {
            let exe = std::env::current_exe().map_err(|_| NvmlError::LibloadingError(e))?;
            let beside = exe
                .parent()
                .and_then(|bin| bin.parent())
                .map(|usr| usr.join("lib/x86_64-linux-gnu/libnvidia-ml.so.1"))
                .filter(|p| p.exists());
            match beside {
                Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
                None => Nvml::init(),
            }
        }
        r => r,
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(code) => return code,
    };
    let nvml = match load() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("{DRIVER_FAILURE}");
            if std::env::var_os("GPU_SIM_DEBUG").is_some() {
                eprintln!("({e})");
            }
            return ExitCode::from(9);
        }
    };
    // The real tool resolves NVML's private export table with dlsym and
    // gives up without it (as under an interposer that does not export it).
    // SAFETY: only the symbol's presence is checked; it is never called.
    let internal = unsafe {
        nvml.lib()
            .__library
            .get::<unsafe extern "C" fn()>(b"nvmlInternalGetExportTable\0")
    };
    if internal.is_err() {
        eprintln!("Failed to initialize NVML: Unknown Error");
        return ExitCode::from(255);
    }
    let devices = match all_devices(&nvml).and_then(|all| match &args.ids {
        Some(ids) => select(&nvml, all, ids),
        None => Ok(all),
    }) {
        Ok(d) => d,
        Err(code) => return code,
    };
    if devices.is_empty() && args.query_gpu.is_none() && args.query_apps.is_none() {
        println!("No devices were found");
        return ExitCode::from(6);
    }
    let out = if args.list {
        Ok(list(&devices))
    } else if args.mig_lgip {
        Ok(mig::list_gip(&nvml, &devices))
    } else if let Some(fields) = &args.query_gpu {
        query_gpu(&nvml, &devices, fields, &args)
    } else if let Some(fields) = &args.query_apps {
        query_apps(&nvml, &devices, fields, &args)
    } else {
        Ok(table(&nvml, &devices))
    };
    match out {
        Ok(s) => {
            print!("{s}");
            ExitCode::SUCCESS
        }
        Err(msg) => {
            eprintln!("{msg}");
            ExitCode::from(2)
        }
    }
}

/// Every device, or the real tool's message and exit code for the first
/// that NVML cannot count or open.
fn all_devices(nvml: &Nvml) -> Result<Vec<Device<'_>>, ExitCode> {
    let count = nvml.device_count().map_err(|e| {
        eprintln!("Unable to determine the device count: {e}");
        ExitCode::from(15)
    })?;
    (0..count)
        .map(|i| {
            nvml.device_by_index(i).map_err(|e| {
                eprintln!("Unable to determine the device handle for GPU {i}: {e}");
                ExitCode::from(15)
            })
        })
        .collect()
}

/// The devices `-i` names (index, UUID or PCI bus id), in its order.
fn select<'n>(
    nvml: &'n Nvml,
    devices: Vec<Device<'n>>,
    ids: &[String],
) -> Result<Vec<Device<'n>>, ExitCode> {
    let mut chosen = Vec::new();
    for id in ids {
        let found = devices.iter().position(|d| {
            id.parse::<u32>().ok() == d.index().ok()
                || d.uuid().is_ok_and(|u| &u == id)
                || d.pci_info()
                    .is_ok_and(|p| p.bus_id.eq_ignore_ascii_case(id))
        });
        match found {
            Some(k) => chosen.push(k),
            None => {
                eprintln!("No devices were found with ID {id}");
                return Err(ExitCode::from(6));
            }
        }
    }
    let indices: Vec<u32> = chosen
        .iter()
        .map(|&k| devices[k].index().unwrap_or(0))
        .collect();
    Ok(indices
        .into_iter()
        .filter_map(|i| nvml.device_by_index(i).ok())
        .collect())
}

fn list(devices: &[Device]) -> String {
    let mut s = String::new();
    for d in devices {
        let _ = writeln!(
            s,
            "GPU {}: {} (UUID: {})",
            d.index().unwrap_or(0),
            d.name().unwrap_or_else(|_| "Unknown".into()),
            d.uuid().unwrap_or_else(|_| "Unknown".into())
        );
        list_mig(&mut s, d);
    }
    s
}

/// The MIG devices under a GPU, as the real tool lists them after it:
/// `  MIG 1g.10gb     Device  0: (UUID: MIG-…)`.
fn list_mig(s: &mut String, d: &Device) {
    let max = d.mig_device_count().unwrap_or(0);
    for i in 0..max {
        let Ok(m) = d.mig_device_by_index(i) else {
            continue;
        };
        let name = m.name().unwrap_or_default();
        let profile = name.rsplit_once(" MIG ").map_or(name.as_str(), |(_, p)| p);
        let _ = writeln!(
            s,
            "  MIG {profile:<12}Device {i:>2}: (UUID: {})",
            m.uuid().unwrap_or_else(|_| "Unknown".into())
        );
    }
}

fn na<T: ToString>(r: Result<T, NvmlError>) -> String {
    r.map(|v| v.to_string()).unwrap_or_else(|_| "N/A".into())
}

fn pstate(d: &Device) -> String {
    match d.performance_state() {
        Ok(PerformanceState::Unknown) | Err(_) => "N/A".into(),
        Ok(p) => format!("P{}", p as u32),
    }
}

fn compute_mode(d: &Device) -> &'static str {
    match d.compute_mode() {
        Ok(ComputeMode::Default) => "Default",
        Ok(ComputeMode::ExclusiveThread) => "E. Thread",
        Ok(ComputeMode::ExclusiveProcess) => "E. Process",
        Ok(ComputeMode::Prohibited) => "Prohibited",
        Err(_) => "N/A",
    }
}

fn now_string() -> String {
    // SAFETY: time/localtime_r/strftime with valid buffers.
    unsafe {
        let t = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&t, &mut tm);
        let mut buf = [0u8; 64];
        let n = libc::strftime(
            buf.as_mut_ptr().cast(),
            buf.len(),
            c"%a %b %e %H:%M:%S %Y".as_ptr(),
            &tm,
        );
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }
}

/// The default table of the 535+ drivers: 91 columns.
fn table(nvml: &Nvml, devices: &[Device]) -> String {
    let sep = format!("+{}+{}+{}+", "-".repeat(41), "-".repeat(24), "-".repeat(22));
    let mut s = table_header(nvml, &sep);
    for d in devices {
        gpu_rows(&mut s, d);
        let _ = writeln!(s, "{sep}");
    }
    s.push('\n');
    processes(&mut s, nvml, devices);
    s
}

/// The box of 91 columns the title and the processes sit in.
fn rule() -> String {
    format!("+{}+", "-".repeat(89))
}

/// The time, the title box (driver and CUDA versions) and the GPU
/// section's column headers, down to its `===` line.
fn table_header(nvml: &Nvml, sep: &str) -> String {
    let mut s = String::new();
    let driver = na(nvml.sys_driver_version());
    let cuda = nvml
        .sys_cuda_driver_version()
        .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
        .unwrap_or_else(|_| "N/A".into());
    let _ = writeln!(s, "{:<31}", now_string());
    let _ = writeln!(s, "{}", rule());
    let _ = writeln!(
        s,
        "| NVIDIA-SMI {driver:<23}Driver Version: {driver:<15}CUDA Version: {cuda:<9}|"
    );
    // Drivers before 560 close the title box with `|...|`, later ones with `+...+`.
    let major: u32 = driver
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    if major < 560 {
        let _ = writeln!(
            s,
            "|{}+{}+{}|",
            "-".repeat(41),
            "-".repeat(24),
            "-".repeat(22)
        );
    } else {
        let _ = writeln!(s, "{sep}");
    }
    s.push_str("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |\n");
    s.push_str("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |\n");
    s.push_str("|                                         |                        |               MIG M. |\n");
    let _ = writeln!(
        s,
        "|{}+{}+{}|",
        "=".repeat(41),
        "=".repeat(24),
        "=".repeat(22)
    );
    s
}

/// A GPU's three lines: identity, sensors and memory, MIG mode.
fn gpu_rows(s: &mut String, d: &Device) {
    let mut name = d.name().unwrap_or_else(|_| "Unknown".into());
    if name.len() > 29 {
        name = format!("{}...", &name[..26]);
    }
    let on_off = |r: Result<bool, NvmlError>| match r {
        Ok(true) => "On",
        Ok(false) => "Off",
        Err(_) => "N/A",
    };
    let pm = on_off(d.is_in_persistent_mode());
    let bus = d
        .pci_info()
        .map(|p| p.bus_id)
        .unwrap_or_else(|_| "N/A".into());
    let disp = on_off(d.is_display_active());
    let ecc = match d.is_ecc_enabled() {
        Ok(e) if e.currently_enabled => "0".to_string(),
        Ok(_) => "Off".into(),
        Err(_) => "N/A".into(),
    };
    let _ = writeln!(
        s,
        "| {:>3}  {name:<30}{pm:>3}  | {bus:>18} {disp:>3} | {ecc:>20} |",
        d.index().unwrap_or(0)
    );
    let or_na = |r: Result<String, NvmlError>| r.unwrap_or_else(|_| "N/A".into());
    let fan = or_na(d.fan_speed(0).map(|f| format!("{f}%")));
    let temp = or_na(
        d.temperature(TemperatureSensor::Gpu)
            .map(|t| format!("{t}C")),
    );
    let pwr = or_na(d.power_usage().map(|p| format!("{}W", p / 1000)));
    let cap = or_na(d.enforced_power_limit().map(|p| format!("{}W", p / 1000)));
    let (used, total) = d
        .memory_info()
        .map(|m| {
            (
                format!("{}MiB", m.used / MIB),
                format!("{}MiB", m.total / MIB),
            )
        })
        .unwrap_or_else(|_| ("N/A".into(), "N/A".into()));
    let util = or_na(d.utilization_rates().map(|u| format!("{}%", u.gpu)));
    let _ = writeln!(
        s,
        "| {fan:>3}   {temp:>3}    {:<2}{pwr:>16} / {cap:>5} | {used:>10} / {total:>9} |{util:>8}{:>13} |",
        pstate(d),
        compute_mode(d)
    );
    let mig = match d.mig_mode() {
        Ok(m) if m.current == 1 => "Enabled",
        Ok(_) => "Disabled",
        Err(_) => "N/A",
    };
    let _ = writeln!(s, "|{:41}|{:24}| {mig:>20} |", "", "");
}

/// The processes box: compute then graphics processes of each GPU.
fn processes(s: &mut String, nvml: &Nvml, devices: &[Device]) {
    let rule = rule();
    let _ = writeln!(s, "{rule}");
    let _ = writeln!(s, "| {:<88}|", "Processes:");
    s.push_str("|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |\n");
    s.push_str("|        ID   ID                                                               Usage      |\n");
    let _ = writeln!(s, "|{}|", "=".repeat(89));
    let mut any = false;
    for d in devices {
        let idx = d.index().unwrap_or(0);
        let compute = d.running_compute_processes().unwrap_or_default();
        let graphics = d.running_graphics_processes().unwrap_or_default();
        let procs = compute
            .iter()
            .map(|p| (p, "C"))
            .chain(graphics.iter().map(|p| (p, "G")));
        for (p, kind) in procs {
            any = true;
            // A process on a MIG device names its GPU and compute instance.
            let id = |v: Option<u32>| v.map_or("N/A".to_string(), |v| v.to_string());
            let _ = writeln!(
                s,
                "|{idx:>5}{:>6}{:>5}{:>16}{kind:>7}   {:<30}{:>16} |",
                id(p.gpu_instance_id),
                id(p.compute_instance_id),
                p.pid,
                process_name(nvml, p.pid),
                match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => format!("{}MiB", b / MIB),
                    UsedGpuMemory::Unavailable => "N/A".into(),
                }
            );
        }
    }
    if !any {
        let _ = writeln!(s, "|  {:<87}|", "No running processes found");
    }
    let _ = writeln!(s, "{rule}");
}

/// The process's name as nvidia-smi shows it: long names keep their last
/// 27 characters after `...`.
fn process_name(nvml: &Nvml, pid: u32) -> String {
    let name = nvml
        .sys_process_name(pid, 256)
        .unwrap_or_else(|_| "N/A".into());
    if name.chars().count() <= 30 {
        return name;
    }
    let tail: String = name
        .chars()
        .rev()
        .take(27)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    format!("...{tail}")
}

/// One CSV value of `--query-gpu`: (header, value with unit, bare value).
fn gpu_field(
    nvml: &Nvml,
    d: &Device,
    count: usize,
    field: &str,
) -> Result<(String, String, String), String> {
    let plain = |h: &str, v: String| Ok((h.to_string(), v.clone(), v));
    let with_unit = |h: &str, unit: &str, v: Result<String, NvmlError>| match v {
        Ok(v) => Ok((format!("{h} [{unit}]"), format!("{v} {unit}"), v)),
        Err(_) => Ok((format!("{h} [{unit}]"), "[N/A]".into(), "[N/A]".into())),
    };
    let mib = |f: fn(&nvml_wrapper::struct_wrappers::device::MemoryInfo) -> u64| {
        d.memory_info().map(|m| (f(&m) / MIB).to_string())
    };
    match field {
        "index" => plain(field, na(d.index())),
        "count" => plain(field, count.to_string()),
        "name" | "gpu_name" => plain("name", na(d.name())),
        "uuid" | "gpu_uuid" => plain("uuid", na(d.uuid())),
        "serial" | "gpu_serial" => plain("serial", na(d.serial())),
        "pci.bus_id" | "gpu_bus_id" => plain("pci.bus_id", na(d.pci_info().map(|p| p.bus_id))),
        "driver_version" => plain(field, na(nvml.sys_driver_version())),
        "pstate" => plain(field, pstate(d)),
        "compute_mode" => plain(field, compute_mode(d).replace("E. ", "Exclusive_")),
        "persistence_mode" => plain(
            field,
            match d.is_in_persistent_mode() {
                Ok(true) => "Enabled".into(),
                Ok(false) => "Disabled".into(),
                Err(_) => "[N/A]".into(),
            },
        ),
        "compute_cap" => plain(
            field,
            na(d.cuda_compute_capability()
                .map(|c| format!("{}.{}", c.major, c.minor))),
        ),
        "temperature.gpu" => plain(field, na(d.temperature(TemperatureSensor::Gpu))),
        "memory.total" => with_unit(field, "MiB", mib(|m| m.total)),
        "memory.used" => with_unit(field, "MiB", mib(|m| m.used)),
        "memory.free" => with_unit(field, "MiB", mib(|m| m.free)),
        "utilization.gpu" => {
            with_unit(field, "%", d.utilization_rates().map(|u| u.gpu.to_string()))
        }
        "utilization.memory" => with_unit(
            field,
            "%",
            d.utilization_rates().map(|u| u.memory.to_string()),
        ),
        "power.draw" => with_unit(
            field,
            "W",
            d.power_usage().map(|p| format!("{:.2}", p as f64 / 1000.0)),
        ),
        "power.limit" => with_unit(
            field,
            "W",
            d.enforced_power_limit()
                .map(|p| format!("{:.2}", p as f64 / 1000.0)),
        ),
        "clocks.sm" => with_unit(field, "MHz", d.clock_info(Clock::SM).map(|c| c.to_string())),
        "clocks.max.sm" => with_unit(
            field,
            "MHz",
            d.max_clock_info(Clock::SM).map(|c| c.to_string()),
        ),
        "fan.speed" => with_unit(field, "%", d.fan_speed(0).map(|c| c.to_string())),
        _ => Err(format!("Field \"{field}\" is not a valid field to query.")),
    }
}

fn csv_out(rows: Vec<Vec<(String, String, String)>>, headers: Vec<String>, args: &Args) -> String {
    let mut s = String::new();
    if args.header {
        let _ = writeln!(s, "{}", headers.join(", "));
    }
    for r in rows {
        let vals: Vec<&str> = r
            .iter()
            .map(|(_, u, b)| if args.units { u.as_str() } else { b.as_str() })
            .collect();
        let _ = writeln!(s, "{}", vals.join(", "));
    }
    s
}

fn query_gpu(
    nvml: &Nvml,
    devices: &[Device],
    fields: &[String],
    args: &Args,
) -> Result<String, String> {
    let mut headers = Vec::new();
    let mut rows = Vec::new();
    for d in devices {
        let row = fields
            .iter()
            .map(|f| gpu_field(nvml, d, devices.len(), f))
            .collect::<Result<Vec<_>, _>>()?;
        rows.push(row);
    }
    // Headers even when no device is present.
    if let Some(r) = rows.first() {
        headers = r.iter().map(|(h, _, _)| h.clone()).collect();
    } else if let Some(f) = fields.iter().next() {
        headers.push(f.clone());
    }
    Ok(csv_out(rows, headers, args))
}

fn query_apps(
    nvml: &Nvml,
    devices: &[Device],
    fields: &[String],
    args: &Args,
) -> Result<String, String> {
    let mut rows = Vec::new();
    let mut headers: Vec<String> = Vec::new();
    for f in fields {
        headers.push(match f.as_str() {
            "used_memory" | "used_gpu_memory" => "used_gpu_memory [MiB]".into(),
            "pid" | "process_name" | "name" | "gpu_uuid" | "gpu_name" | "gpu_bus_id"
            | "gpu_serial" => f.clone(),
            _ => return Err(format!("Field \"{f}\" is not a valid field to query.")),
        });
    }
    for d in devices {
        for p in d.running_compute_processes().unwrap_or_default() {
            let mut row = Vec::new();
            for f in fields {
                let v = match f.as_str() {
                    "pid" => p.pid.to_string(),
                    "process_name" | "name" => na(nvml.sys_process_name(p.pid, 256)),
                    "used_memory" | "used_gpu_memory" => {
                        let (u, b) = match p.used_gpu_memory {
                            UsedGpuMemory::Used(b) => {
                                (format!("{} MiB", b / MIB), (b / MIB).to_string())
                            }
                            UsedGpuMemory::Unavailable => ("[N/A]".into(), "[N/A]".into()),
                        };
                        row.push((String::new(), u, b));
                        continue;
                    }
                    other => gpu_field(nvml, d, devices.len(), other)?.1,
                };
                row.push((String::new(), v.clone(), v));
            }
            rows.push(row);
        }
    }
    Ok(csv_out(rows, headers, args))
}
