//! The manager's event log (`CUMEM_CONF` key `log`): every allocation
//! and free, written by [`EventLog`] in RMM's log CSV format.

use super::MemoryManager;
use crate::error::Result;
use crate::log::EventLog;

impl MemoryManager {
    /// The event log, when the configuration names one
    /// ([`Config::log_path`](crate::Config::log_path)).
    pub fn event_log(&self) -> Option<&EventLog> {
        self.log.as_ref()
    }

    /// Waits until every event logged so far is in the log file (nothing
    /// to do without a log). Dropping the manager, or
    /// [`shutdown`](crate::MemoryManager::shutdown), flushes it too.
    ///
    /// # Errors
    /// The log's first write error.
    pub fn flush_event_log(&self) -> Result<()> {
        self.log.as_ref().map_or(Ok(()), EventLog::flush)
    }
}
