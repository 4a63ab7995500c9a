//! `cargo run -p hello-tool` serves the letter-counting agent on 127.0.0.1:8090, with its database in
//! `./hello-data`. Ctrl-C stops it; runs that were mid-way continue when it starts again.

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    std::fs::create_dir_all("hello-data")?;
    let keel = hello_tool::build("sqlite://hello-data/keel.db").await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:8090").await?;
    println!("hello-tool listening on http://{}/", listener.local_addr()?);
    keel.serve(listener, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
