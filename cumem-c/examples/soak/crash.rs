//! A backtrace on SIGSEGV / SIGBUS, so a crash on the device machine says
//! where it happened (best effort: capturing a backtrace in a signal
//! handler is not async-signal-safe, but the process is dying anyway).

extern "C" fn on_fault(sig: libc::c_int) {
    let bt = std::backtrace::Backtrace::force_capture();
    eprintln!("soak: FATAL signal {sig} in thread {:?}\n{bt}", std::thread::current().name());
    // SAFETY: restores the default action and re-raises to die with it.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// Installs the handler.
pub fn install() {
    for sig in [libc::SIGSEGV, libc::SIGBUS] {
        // SAFETY: `on_fault` has the signature a handler needs.
        unsafe { libc::signal(sig, on_fault as *const () as libc::sighandler_t) };
    }
}
