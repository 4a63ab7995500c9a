//! `sqlx::migrate!` embeds the files of `migrations/` at compile time; a stable compiler does not
//! tell cargo that the crate reads them, so a migration added or edited would leave an incremental
//! build with the old set. This makes cargo rebuild the crate when one changes.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
