//! Model adapters. For now: the offline [`DemoModel`].
#![forbid(unsafe_code)]

pub mod demo;

pub use demo::DemoModel;
