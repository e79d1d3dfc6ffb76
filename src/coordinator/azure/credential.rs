//! Who the coordinator is to Azure: a token credential of Microsoft's `azure_identity`
//! (managed identity, workload identity or a service principal), which fetches, caches
//! and refreshes the tokens. Its HTTP goes through the coordinator's own reqwest client
//! (ring's TLS, as everywhere else in sched-relay).

use std::sync::Arc;

use azure_core::credentials::{Secret, TokenCredential};
use azure_core::http::{AsyncRawResponse, ClientOptions, HttpClient, Request, Transport, Url};
use azure_identity::{
    ClientAssertionCredentialOptions, ClientSecretCredential, ClientSecretCredentialOptions,
    ManagedIdentityCredential, ManagedIdentityCredentialOptions, UserAssignedId,
    WorkloadIdentityCredential, WorkloadIdentityCredentialOptions,
};

use super::{AZURE_IDENTITY_ENDPOINT, AzureConfig, Credential};

/// The credential `[azure] credential` names.
pub fn build(
    config: &AzureConfig,
    http: reqwest::Client,
) -> Result<Arc<dyn TokenCredential>, String> {
    let identity_endpoint = Url::parse(&config.managed_identity_endpoint)
        .map_err(|e| format!("azure.managed_identity_endpoint: {e}"))?;
    let client_options = ClientOptions {
        transport: Some(Transport::new(Arc::new(Relayed {
            http,
            identity_endpoint,
        }))),
        ..ClientOptions::default()
    };
    let env = |name: &str| {
        std::env::var(name).map_err(|_| {
            format!(
                "azure.credential = {:?} needs the environment variable {name}",
                credential_name(config.credential)
            )
        })
    };
    let credential: Arc<dyn TokenCredential> = match config.credential {
        Credential::ManagedIdentity => {
            ManagedIdentityCredential::new(Some(ManagedIdentityCredentialOptions {
                user_assigned_id: config.client_id.clone().map(UserAssignedId::ClientId),
                client_options,
            }))
            .map_err(|e| format!("azure: managed identity: {e}"))?
        }
        Credential::WorkloadIdentity => {
            WorkloadIdentityCredential::new(Some(WorkloadIdentityCredentialOptions {
                credential_options: ClientAssertionCredentialOptions { client_options },
                ..WorkloadIdentityCredentialOptions::default()
            }))
            .map_err(|e| format!("azure: workload identity: {e}"))?
        }
        Credential::ClientSecret => ClientSecretCredential::new(
            &env("AZURE_TENANT_ID")?,
            env("AZURE_CLIENT_ID")?,
            Secret::new(env("AZURE_CLIENT_SECRET")?),
            Some(ClientSecretCredentialOptions { client_options }),
        )
        .map_err(|e| format!("azure: service principal: {e}"))?,
    };
    Ok(credential)
}

fn credential_name(credential: Credential) -> &'static str {
    match credential {
        Credential::ManagedIdentity => "managed_identity",
        Credential::WorkloadIdentity => "workload_identity",
        Credential::ClientSecret => "client_secret",
    }
}

/// The credential's transport: the coordinator's reqwest client, which sends what
/// `azure_identity` addresses to the metadata service (169.254.169.254) to
/// `[azure] managed_identity_endpoint` instead (the simulator's, in tests), and everything
/// else where it is addressed.
#[derive(Debug)]
struct Relayed {
    http: reqwest::Client,
    identity_endpoint: Url,
}

#[async_trait::async_trait]
impl HttpClient for Relayed {
    async fn execute_request(&self, request: &Request) -> azure_core::Result<AsyncRawResponse> {
        let Some(relayed) = relay(request.url(), &self.identity_endpoint) else {
            return self.http.execute_request(request).await;
        };
        let mut request = request.clone();
        *request.url_mut() = relayed;
        self.http.execute_request(&request).await
    }
}

/// `url` sent to `endpoint` instead, when it is addressed to Azure's metadata service and
/// the endpoint is another.
fn relay(url: &Url, endpoint: &Url) -> Option<Url> {
    let azure = Url::parse(AZURE_IDENTITY_ENDPOINT).expect("a valid URL");
    if url.origin() != azure.origin() || endpoint.origin() == azure.origin() {
        return None;
    }
    let mut relayed = endpoint.clone();
    relayed.set_path(url.path());
    relayed.set_query(url.query());
    Some(relayed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_goes_to_the_metadata_service_is_relayed_to_the_configured_endpoint() {
        let endpoint = Url::parse("http://127.0.0.1:8300").unwrap();
        let token = Url::parse(
            "http://169.254.169.254/metadata/identity/oauth2/token?api-version=2019-08-01&resource=x",
        )
        .unwrap();
        assert_eq!(
            relay(&token, &endpoint).unwrap().as_str(),
            "http://127.0.0.1:8300/metadata/identity/oauth2/token?api-version=2019-08-01&resource=x"
        );
        let entra = Url::parse("https://login.microsoftonline.com/t/oauth2/v2.0/token").unwrap();
        assert_eq!(relay(&entra, &endpoint), None);
        let azure = Url::parse(AZURE_IDENTITY_ENDPOINT).unwrap();
        assert_eq!(relay(&token, &azure), None);
    }
}
