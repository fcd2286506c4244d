use clap::{Parser, Subcommand};

use weft_grpc::generate::{self, GenerateArgs};

#[derive(Parser)]
#[command(name = "weft", version, about = "Multi-tenant LLM serving on MLX")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download and convert a known model into the cache (default:
    /// SmolLM2-135M-Instruct; also gemma3-270m) and print its directory.
    Pull {
        /// The model's name (SmolLM2-135M-Instruct, gemma3-270m).
        model: Option<String>,
    },
    /// Generate a completion for one prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Load generator: Weft gRPC or OpenAI-compatible HTTP (e.g. mlx_lm.server).
    Bench(weft_grpc::bench::BenchArgs),
    /// In-process batched throughput of the engine (no gRPC); see benches/.
    BenchEngine(weft_grpc::engine_bench::EngineBenchArgs),
    // About and long help come from `ServeArgs`'s doc comment.
    Serve(Box<weft_grpc::server::ServeArgs>),
    /// Print the sha256 hash of an API key, for the tenant file.
    HashKey {
        /// The API key (read from stdin when omitted or "-").
        key: Option<String>,
    },
}

fn main() {
    let mlx_defaults = weft_grpc::mlx_env::apply_defaults();
    weft_grpc::blas::maybe_reexec_with_openblas();
    weft_grpc::malloc::tune();
    let cli = Cli::parse();
    // A server logs one line per request; the one-shot commands stay quiet.
    let default_filter = match cli.command {
        Command::Serve(_) => "info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    for (k, v) in &mlx_defaults {
        tracing::debug!("{k}={v} (Weft's default; set it to keep MLX's)");
    }
    let result = match cli.command {
        Command::Pull { model } => pull(model.as_deref().unwrap_or("")),
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => weft_grpc::bench::run_blocking(args).map(|_| ()),
        Command::Serve(args) => weft_grpc::server::run(*args),
        Command::HashKey { key } => hash_key(key),
        Command::BenchEngine(args) => weft_grpc::engine_bench::run(args).map(|_| ()),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn pull(name: &str) -> anyhow::Result<()> {
    let Some(model) = weft_gguf::find_model(name) else {
        anyhow::bail!(
            "unknown model {name:?} (known: {})",
            weft_grpc::runtime::known_model_names()
        );
    };
    let dir = model.pull(&weft_grpc::paths::cache_dir(), true)?;
    println!("{}", dir.display());
    Ok(())
}

fn hash_key(key: Option<String>) -> anyhow::Result<()> {
    let key = match key.filter(|k| k != "-") {
        Some(k) => k,
        None => {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line)?;
            line.trim_end_matches(['\r', '\n']).to_string()
        }
    };
    if key.is_empty() {
        anyhow::bail!("the key is empty");
    }
    println!("{}", weft_grpc::server::tenants::hash_key(&key));
    Ok(())
}
