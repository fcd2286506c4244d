//! The `weft.v1.Admin` service: LoRA adapters mounted and unmounted at run
//! time (see [`crate::adapters`]). Only tenants the tenant file grants
//! `manage_adapters = true` may call it (every caller in open mode, which
//! binds loopback only).

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::service::{counted_call, Refusals, State};
use crate::pb;

pub struct AdminService {
    state: Arc<State>,
}

impl AdminService {
    pub fn new(state: Arc<State>) -> Self {
        Self { state }
    }

    /// Authenticates and authorizes, runs `f`, and counts the call.
    async fn call<T, R, F, Fut>(
        &self,
        method: &'static str,
        req: Request<T>,
        f: F,
    ) -> Result<Response<R>, Status>
    where
        F: FnOnce(&'static str, T) -> Fut,
        Fut: std::future::Future<Output = Result<R, Status>>,
    {
        let draining = self.state.is_draining();
        counted_call(&self.state, method, req, Refusals::Info, |tenant, req| async move {
            if !tenant.manage_adapters {
                Err(Status::permission_denied(format!(
                    "tenant {:?} may not manage adapters (manage_adapters = true in the tenant file grants it)",
                    tenant.name
                )))
            } else if draining {
                Err(Status::unavailable("the server is shutting down"))
            } else {
                f(method, req.into_inner()).await
            }
        })
        .await
    }
}

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn load_adapter(
        &self,
        req: Request<pb::LoadAdapterRequest>,
    ) -> Result<Response<pb::AdapterInfo>, Status> {
        let state = self.state.clone();
        self.call("LoadAdapter", req, |_, r| async move {
            let ready = state.ready()?;
            let a = ready
                .model
                .adapters
                .mount(&ready.engine, &ready.model.name, &r.name, &r.path)
                .await?;
            Ok(a.info())
        })
        .await
    }

    async fn unload_adapter(
        &self,
        req: Request<pb::UnloadAdapterRequest>,
    ) -> Result<Response<pb::UnloadAdapterResponse>, Status> {
        let state = self.state.clone();
        self.call("UnloadAdapter", req, |_, r| async move {
            let ready = state.ready()?;
            let live = ready.model.adapters.unmount(&ready.engine, &r.name).await?;
            Ok(pb::UnloadAdapterResponse {
                live_requests: live as u32,
            })
        })
        .await
    }
}
