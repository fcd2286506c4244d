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
    /// Download and convert the default model (SmolLM2-135M-Instruct) into the cache.
    Pull,
    /// Generate a completion for one prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Load generator: Weft gRPC or OpenAI-compatible HTTP (e.g. mlx_lm.server).
    Bench(weft_grpc::bench::BenchArgs),
    /// In-process batched throughput of the engine (no gRPC); see benches/.
    BenchEngine(weft_grpc::engine_bench::EngineBenchArgs),
}

fn main() {
    weft_grpc::blas::maybe_reexec_with_openblas();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Pull => weft_grpc::runtime::resolve_model("", true).map(|dir| {
            println!("{}", dir.display());
        }),
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => weft_grpc::bench::run_blocking(args).map(|_| ()),
        Command::BenchEngine(args) => weft_grpc::engine_bench::run(args).map(|_| ()),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
