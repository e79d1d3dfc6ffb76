//! `/fleet`, `/healthz` and the admin endpoint over real HTTP, as the instance's role and
//! its lease's freshness change: only an instance that may act shows its fleet or takes an
//! operator's command.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::super::{admin, role::Role, serve};

const TOKEN: &str = "an-operator-token-of-some-length";

struct Served {
    base: String,
    role: Arc<Role>,
    fresh: Arc<AtomicBool>,
    http: reqwest::Client,
}

impl Served {
    async fn start() -> Served {
        crate::install_crypto_provider();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let snapshot = Arc::new(std::sync::RwLock::new(bytes::Bytes::from_static(
            b"{\"groups\":[]}",
        )));
        let role = Role::new();
        let fresh = Arc::new(AtomicBool::new(true));
        let lease = fresh.clone();
        role.gated_by(Arc::new(move || lease.load(Ordering::SeqCst)));
        let (requests, mut commands) = tokio::sync::mpsc::channel::<admin::Request>(4);
        // The engine's side: every command is done.
        tokio::spawn(async move {
            while let Some((_, answer)) = commands.recv().await {
                let _ = answer.send(Ok("done".into()));
            }
        });
        let endpoint = admin::Endpoint {
            token: Some(Arc::from(TOKEN)),
            requests,
        };
        tokio::spawn(serve(listener, snapshot, role.clone(), endpoint));
        Served {
            base,
            role,
            fresh,
            http: reqwest::Client::new(),
        }
    }

    async fn get(&self, path: &str) -> (u16, String) {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    }

    async fn pause(&self) -> u16 {
        let response = self
            .http
            .post(format!("{}/pause", self.base))
            .bearer_auth(TOKEN)
            .body("{\"reason\":\"test\"}")
            .send()
            .await
            .unwrap();
        response.status().as_u16()
    }
}

#[tokio::test]
async fn an_active_instance_whose_lease_is_not_fresh_shows_no_fleet_and_takes_no_command() {
    let served = Served::start().await;
    served.role.set("active");
    assert_eq!(served.get("/fleet").await, (200, "{\"groups\":[]}".into()));
    assert_eq!(served.get("/healthz").await, (200, "active\n".into()));
    assert_eq!(served.pause().await, 200);

    // Its last renewal is too old to act on: a standby may be taking over.
    served.fresh.store(false, Ordering::SeqCst);
    let (status, body) = served.get("/fleet").await;
    assert_eq!(status, 503, "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["role"], "paused", "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("not been renewed"),
        "{body}"
    );
    assert_eq!(served.get("/healthz").await, (200, "paused\n".into()));
    assert_eq!(served.pause().await, 503);

    // A renewal succeeded: it acts, and shows, again.
    served.fresh.store(true, Ordering::SeqCst);
    assert_eq!(served.get("/fleet").await.0, 200);
    assert_eq!(served.get("/healthz").await.1, "active\n");
}

#[tokio::test]
async fn an_instance_without_the_lease_shows_no_fleet_even_with_one_written() {
    let served = Served::start().await;
    for (role, said) in [("standby", "standby"), ("starting", "starting")] {
        served.role.set(role);
        let (status, body) = served.get("/fleet").await;
        assert_eq!(status, 503, "{role}: {body}");
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["role"], said, "{body}");
        assert_eq!(served.get("/healthz").await.1, format!("{said}\n"));
        assert_eq!(served.pause().await, 503);
    }
}
