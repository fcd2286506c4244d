//! Weft's front end: the `weft.v1` gRPC services, tenants and limits, the
//! metrics endpoint, and the subcommands of the `weft` binary.

pub mod adapters;
pub mod bench;
pub mod blas;
pub mod codec;
pub mod constraints;
pub mod engine_bench;
pub mod engine_bench_long;
pub mod generate;
pub mod malloc;
pub mod memory_plan;
pub mod mlx_env;
pub mod paths;
pub mod runtime;
pub mod server;
pub mod units;

/// Generated `weft.v1` types, client and server.
pub mod pb {
    tonic::include_proto!("weft.v1");

    /// Encoded file descriptors, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("weft_descriptor");
}
