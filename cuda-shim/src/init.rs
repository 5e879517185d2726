//! cuInit: decide the mode, register, then initialise the real driver.

use crate::config::{self, Mode};
use crate::log;
use crate::real::real_cuda;
use crate::registration::{REFUSED, proc};
use cuda_abi::CUresult;

cuda_exports! {
    fn cuInit(flags: u32) {
        match config::mode() {
            Mode::PassThrough => {}
            Mode::Closed(reason) => {
                log::fail_closed(reason);
                return REFUSED;
            }
            Mode::Enforce(_) => {
                // Fail closed before the device is touched.
                if let Err(e) = proc().ensure_registered() {
                    return e;
                }
            }
        }
        if let Err(e) = crate::real::handle(crate::real::Lib::Cuda) {
            log::fail_closed(e);
            return cuda_abi::CUDA_ERROR_NO_DEVICE;
        }
        let f = real_cuda!(cuInit: unsafe extern "C" fn(u32) -> CUresult);
        f(flags)
    }
}
