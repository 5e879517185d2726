//! The interposer's side of the tests and benchmarks: a sim node whose
//! driver tree is a vdriver mirror with the interposer in it ([`simnode`]),
//! the manager's registration server ([`server`]), workloads run under it
//! ([`workload`], [`stepped`], the TP = 2 server [`tp`]), the compute
//! accuracy matrix ([`matrix`]) and benchmark reports ([`report`]).

pub mod matrix;
pub mod report;
pub mod server;
pub mod simnode;
pub mod stepped;
pub mod tp;
pub mod workload;
