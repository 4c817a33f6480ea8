//! `ambitctl proxy-status`, `ztunnel-config` and `authn tls-check` against
//! a live mesh: the in-process control plane and a ztunnel per node of the
//! netns bed, pods enrolled through ZDS, STRICT mTLS, one connection
//! through a Service VIP.
//!
//! Needs root, `ip` and `iptables`; prints SKIP and passes otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use ambit_tests::eventually;
use ambit_tests::meshbed::{MeshBed, PodSpec, WAIT};
use ambit_tests::netbed;
use ambitctl::analyze::{Files, Source};
use ambitctl::ztunnel_config::{self, Section};
use ambitctl::{authn, proxy_status};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const VIP: &str = "10.96.0.10";

fn extra() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: server\n  namespace: ai\nspec:\n  \
         clusterIP: {VIP}\n  selector: {{app: server}}\n  ports:\n  - {{name: tcp, port: 80, targetPort: 8080}}\n\
         ---\napiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata:\n  name: strict\n  namespace: ai\n\
         spec:\n  mtls: {{mode: STRICT}}\n"
    )
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_status_ztunnel_config_and_tls_check_on_a_live_mesh() {
    if !netbed::can_run("proxy_status_ztunnel_config_and_tls_check_on_a_live_mesh") {
        return;
    }
    let pods = [
        PodSpec::mesh("client", "ai", 0, "client"),
        PodSpec::mesh("server-0", "ai", 1, "server"),
    ];
    let mut bed = MeshBed::new(2, &pods).unwrap();
    bed.start(&extra()).await.unwrap();
    let _echo = bed.echo("server-0", 8080).await.unwrap();
    let t = Duration::from_secs(5);

    // proxy-status: both ztunnels, address and authorization SYNCED.
    let mon = bed.control_plane().unwrap().monitoring_addr();
    eventually(WAIT, "both ztunnels SYNCED", || async move {
        let s = blocking(move || proxy_status::collect(mon, t)).await.ok()?;
        let zt: Vec<_> = s.proxies.iter().filter(|p| p.kind == "ztunnel").collect();
        (zt.len() == 2
            && zt.iter().all(|p| {
                p.synced()
                    && p.types.iter().any(|t| t.type_ == "address")
                    && p.types.iter().any(|t| t.type_ == "authorization")
            }))
        .then_some(())
    })
    .await
    .unwrap();
    let status = blocking(move || proxy_status::collect(mon, t))
        .await
        .unwrap();
    let table = proxy_status::render(&status);
    assert!(
        table.contains("ADDRESS") && table.contains("SYNCED ("),
        "{table}"
    );

    // ztunnel-config: workloads, services, policies, certificates.
    let admin = bed.ztunnel(0).admin_addr();
    let workloads = blocking(move || ztunnel_config::dump_section(admin, Section::Workloads, t))
        .await
        .unwrap();
    let w = ztunnel_config::render_section(Section::Workloads, &workloads);
    assert!(
        w.contains("client") && w.contains("server-0") && w.contains("HBONE"),
        "{w}"
    );
    let services = blocking(move || ztunnel_config::dump_section(admin, Section::Services, t))
        .await
        .unwrap();
    let sv = ztunnel_config::render_section(Section::Services, &services);
    assert!(sv.contains("server") && sv.contains(VIP), "{sv}");
    let policies = blocking(move || ztunnel_config::dump_section(admin, Section::Policies, t))
        .await
        .unwrap();
    let p = ztunnel_config::render_section(Section::Policies, &policies);
    assert!(p.contains("istio_converted_static_strict"), "{p}");
    let certs = blocking(move || ztunnel_config::dump_section(admin, Section::Certificates, t))
        .await
        .unwrap();
    let c = ztunnel_config::render_section(Section::Certificates, &certs);
    assert!(c.contains("spiffe://cluster.local/ns/ai/sa/client"), "{c}");

    // One connection client -> VIP: both ztunnels count it as mutual_tls.
    let vip: SocketAddr = format!("{VIP}:80").parse().unwrap();
    let mut s = bed.connect("client", vip).await.unwrap();
    tokio::time::timeout(WAIT, async {
        s.write_all(b"ping").await.unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).await.unwrap();
    })
    .await
    .unwrap();
    drop(s);
    let stats1 = bed.ztunnel(1).stats_addr();
    let rows = eventually(
        WAIT,
        "the connection in ztunnel-config connections",
        || async move {
            let rows = blocking(move || ztunnel_config::collect_connections(stats1, t))
                .await
                .ok()?;
            rows.iter()
                .any(|r| {
                    r.reporter == "destination"
                        && r.security_policy == "mutual_tls"
                        && r.opened >= 1
                })
                .then_some(rows)
        },
    )
    .await
    .unwrap();
    let table = ztunnel_config::render_connections(&rows);
    assert!(
        table.contains("ai/client") && table.contains("mutual_tls"),
        "{table}"
    );

    // tls-check: STRICT from ai/strict, live traffic mutual_tls.
    let dir = bed.config_dir().to_path_buf();
    let text = blocking(move || {
        let m: Vec<String> = [stats1]
            .iter()
            .map(|a| ambitctl::http::get(*a, "/metrics", "ztunnel", t).unwrap())
            .collect();
        let objects = Files::new([dir])
            .documents()
            .unwrap()
            .into_iter()
            .filter_map(|d| d.decoded.ok().flatten())
            .collect();
        authn::tls_check(objects, &m, None, Some("server"))
    })
    .await;
    assert_eq!(text.len(), 1, "{text:#?}");
    let row = &text[0];
    assert_eq!(row.mode, "STRICT");
    assert_eq!(row.decided_by, "PeerAuthentication ai/strict (namespace)");
    assert!(
        row.live_mutual_tls >= 1 && row.live_plaintext == 0,
        "{row:#?}"
    );
    let rendered = authn::render(&text);
    assert!(
        rendered.contains("STRICT") && rendered.contains("mutual_tls ("),
        "{rendered}"
    );
}
