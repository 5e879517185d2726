//! Request validation done by the runtime for every plugin, so a plugin never
//! sees unknown IDs, empty requests or requests larger than it could serve.
//! Every rejection is `InvalidArgument` and names the field and IDs at fault.

use std::collections::HashSet;
use tonic::Status;
use vcuda_api::deviceplugin::v1beta1::{
    AllocateRequest, Device, PreStartContainerRequest, PreferredAllocationRequest,
};

/// Most container requests accepted in one call. kubelet sends one container
/// per call; anything far above that is a broken or hostile client.
pub const MAX_CONTAINER_REQUESTS: usize = 64;

/// How many offending IDs an error message lists before eliding the rest.
const MAX_LISTED: usize = 8;

fn list(ids: &[&str]) -> String {
    let mut s = ids
        .iter()
        .take(MAX_LISTED)
        .map(|i| format!("{i:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    if ids.len() > MAX_LISTED {
        s.push_str(&format!(" and {} more", ids.len() - MAX_LISTED));
    }
    format!("[{s}]")
}

/// Checks one list of device IDs against the plugin's devices.
fn check_ids(field: &str, ids: &[String], known: &HashSet<&str>) -> Result<(), Status> {
    if ids.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{field} is empty: at least one device ID is required"
        )));
    }
    if ids.len() > known.len() {
        return Err(Status::invalid_argument(format!(
            "{field} has {} device IDs but this plugin has only {} devices",
            ids.len(),
            known.len()
        )));
    }
    let unknown: Vec<&str> = ids
        .iter()
        .map(String::as_str)
        .filter(|i| !known.contains(i))
        .collect();
    if !unknown.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{field}: unknown device IDs {}",
            list(&unknown)
        )));
    }
    let mut seen = HashSet::with_capacity(ids.len());
    let dups: Vec<&str> = ids
        .iter()
        .map(String::as_str)
        .filter(|i| !seen.insert(*i))
        .collect();
    if !dups.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{field}: duplicate device IDs {}",
            list(&dups)
        )));
    }
    Ok(())
}

fn check_count(field: &str, n: usize) -> Result<(), Status> {
    if n == 0 {
        return Err(Status::invalid_argument(format!(
            "{field} is empty: at least one container request is required"
        )));
    }
    if n > MAX_CONTAINER_REQUESTS {
        return Err(Status::invalid_argument(format!(
            "{field} has {n} container requests, more than the limit of {MAX_CONTAINER_REQUESTS}"
        )));
    }
    Ok(())
}

fn known(devices: &[Device]) -> HashSet<&str> {
    devices.iter().map(|d| d.id.as_str()).collect()
}

pub fn allocate(req: &AllocateRequest, devices: &[Device]) -> Result<(), Status> {
    check_count("container_requests", req.container_requests.len())?;
    let known = known(devices);
    for (i, c) in req.container_requests.iter().enumerate() {
        check_ids(
            &format!("container_requests[{i}].devices_ids"),
            &c.devices_ids,
            &known,
        )?;
    }
    Ok(())
}

pub fn pre_start(req: &PreStartContainerRequest, devices: &[Device]) -> Result<(), Status> {
    check_ids("devices_ids", &req.devices_ids, &known(devices))
}

pub fn preferred(req: &PreferredAllocationRequest, devices: &[Device]) -> Result<(), Status> {
    check_count("container_requests", req.container_requests.len())?;
    let known = known(devices);
    for (i, c) in req.container_requests.iter().enumerate() {
        let avail_field = format!("container_requests[{i}].available_deviceIDs");
        check_ids(&avail_field, &c.available_device_i_ds, &known)?;
        let must_field = format!("container_requests[{i}].must_include_deviceIDs");
        if !c.must_include_device_i_ds.is_empty() {
            check_ids(&must_field, &c.must_include_device_i_ds, &known)?;
        }
        let avail: HashSet<&str> = c.available_device_i_ds.iter().map(String::as_str).collect();
        let outside: Vec<&str> = c
            .must_include_device_i_ds
            .iter()
            .map(String::as_str)
            .filter(|i| !avail.contains(i))
            .collect();
        if !outside.is_empty() {
            return Err(Status::invalid_argument(format!(
                "{must_field}: device IDs {} are not in available_deviceIDs",
                list(&outside)
            )));
        }
        let size = c.allocation_size;
        if size <= 0 || size as usize > c.available_device_i_ds.len() {
            return Err(Status::invalid_argument(format!(
                "container_requests[{i}].allocation_size is {size}; it must be between 1 and the {} available devices",
                c.available_device_i_ds.len()
            )));
        }
        if (size as usize) < c.must_include_device_i_ds.len() {
            return Err(Status::invalid_argument(format!(
                "container_requests[{i}].allocation_size is {size}, smaller than the {} must_include_deviceIDs",
                c.must_include_device_i_ds.len()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::device;
    use tonic::Code;
    use vcuda_api::deviceplugin::v1beta1::{
        ContainerAllocateRequest, ContainerPreferredAllocationRequest,
    };

    fn devs() -> Vec<Device> {
        (0..4)
            .map(|i| device(format!("d{i}"), true, None))
            .collect()
    }

    fn alloc(ids: &[&[&str]]) -> AllocateRequest {
        AllocateRequest {
            container_requests: ids
                .iter()
                .map(|c| ContainerAllocateRequest {
                    devices_ids: c.iter().map(|s| s.to_string()).collect(),
                })
                .collect(),
        }
    }

    fn msg(r: Result<(), Status>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        e.message().to_string()
    }

    #[test]
    fn good_allocate_passes() {
        allocate(&alloc(&[&["d0", "d1"], &["d3"]]), &devs()).unwrap();
    }

    #[test]
    fn unknown_ids_are_named() {
        let m = msg(allocate(
            &alloc(&[&["d0"], &["d1", "nope", "gone"]]),
            &devs(),
        ));
        assert!(m.contains("container_requests[1].devices_ids"), "{m}");
        assert!(m.contains("\"nope\"") && m.contains("\"gone\""), "{m}");
        assert!(!m.contains("\"d1\""), "{m}");
    }

    #[test]
    fn empty_requests_are_rejected() {
        assert!(msg(allocate(&alloc(&[]), &devs())).contains("container_requests is empty"));
        assert!(
            msg(allocate(&alloc(&[&[]]), &devs()))
                .contains("container_requests[0].devices_ids is empty")
        );
        assert!(
            msg(pre_start(
                &PreStartContainerRequest {
                    devices_ids: vec![]
                },
                &devs()
            ))
            .contains("devices_ids")
        );
    }

    #[test]
    fn oversized_requests_are_rejected() {
        let m = msg(allocate(
            &alloc(&[&["d0", "d1", "d2", "d3", "d4"]]),
            &devs(),
        ));
        assert!(m.contains("5 device IDs") && m.contains("only 4"), "{m}");
        let many: Vec<&[&str]> = vec![&["d0"]; MAX_CONTAINER_REQUESTS + 1];
        assert!(msg(allocate(&alloc(&many), &devs())).contains("65 container requests"));
    }

    #[test]
    fn duplicates_are_rejected() {
        assert!(
            msg(allocate(&alloc(&[&["d0", "d0"]]), &devs()))
                .contains("duplicate device IDs [\"d0\"]")
        );
    }

    #[test]
    fn long_lists_are_elided() {
        let ids: Vec<String> = (0..3).map(|i| format!("x{i}")).collect();
        let many: Vec<Device> = (0..20)
            .map(|i| device(format!("d{i}"), true, None))
            .collect();
        let req = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: ids
                    .iter()
                    .cloned()
                    .chain((0..10).map(|i| format!("y{i}")))
                    .collect(),
            }],
        };
        let m = msg(allocate(&req, &many));
        assert!(m.contains("and 5 more"), "{m}");
    }

    #[test]
    fn preferred_checks_sizes_and_subsets() {
        let req = |avail: &[&str], must: &[&str], size| PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: avail.iter().map(|s| s.to_string()).collect(),
                must_include_device_i_ds: must.iter().map(|s| s.to_string()).collect(),
                allocation_size: size,
            }],
        };
        preferred(&req(&["d0", "d1"], &["d1"], 2), &devs()).unwrap();
        assert!(
            msg(preferred(&req(&["d0", "d1"], &[], 3), &devs())).contains("allocation_size is 3")
        );
        assert!(
            msg(preferred(&req(&["d0", "d1"], &[], 0), &devs())).contains("allocation_size is 0")
        );
        assert!(
            msg(preferred(&req(&["d0"], &["d2"], 1), &devs()))
                .contains("not in available_deviceIDs")
        );
        assert!(
            msg(preferred(&req(&["d0", "q"], &[], 1), &devs()))
                .contains("unknown device IDs [\"q\"]")
        );
    }
}
