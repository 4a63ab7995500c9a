//! WebSocket transport tests.
