//! Benchmarks' results as ready-to-paste markdown (cuda-shim/README.md and
//! the top-level README take their figures from this output): the rows,
//! then a line saying what produced them and on what.

/// The 1-minute load average (the machine may be shared: figures taken
/// under load are noisier).
pub fn load() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Collects markdown rows; [`Markdown::print`] writes the table.
pub struct Markdown {
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
    load_at_start: f64,
}

impl Markdown {
    pub fn new(header: &[&'static str]) -> Markdown {
        Markdown {
            header: header.to_vec(),
            rows: Vec::new(),
            load_at_start: load(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table, and where it comes from: `command`, on `what`.
    pub fn print(&self, command: &str, what: &str) {
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        // The interposer and the sim come from the bench's own profile
        // directory (target/release for `cargo bench`).
        let exe = std::env::current_exe().unwrap_or_default();
        let profile = exe
            .parent()
            .and_then(|d| d.parent())
            .and_then(|d| d.file_name())
            .map_or("?".into(), |n| n.to_string_lossy().into_owned());
        println!("\nmarkdown:\n");
        println!("| {} |", self.header.join(" | "));
        println!("|{}", "---|".repeat(self.header.len()));
        for r in &self.rows {
            println!("| {} |", r.join(" | "));
        }
        println!(
            "\n`{command}` (target/{profile}), {what}, on {cores} cores at a load average of {:.1} → {:.1}.",
            self.load_at_start,
            load()
        );
    }
}
