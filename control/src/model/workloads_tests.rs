//! Translation tests: YAML in, decoded `istio.workload.Address` /
//! `istio.security.Authorization` resources out.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;

use ambit_proto::security::Authorization;
use ambit_proto::workload::{
    Address, GatewayAddress, Port, Service, TunnelProtocol, Workload, WorkloadStatus, address,
    gateway_address,
};
use prost::Message;

use super::snapshot::Snapshot;
use super::{ModelOptions, Store, build_snapshot};
use ambit_config::parse_documents;

pub(crate) fn store_from(yaml: &str) -> Store {
    let (objs, errs) = parse_documents(Path::new("test.yaml"), yaml);
    assert!(errs.is_empty(), "unexpected config errors: {errs:#?}");
    Store::from_objects(objs)
}

pub(crate) struct Out {
    pub snap: Snapshot,
    pub workloads: BTreeMap<String, Workload>,
    pub services: BTreeMap<String, Service>,
    pub policies: BTreeMap<String, Authorization>,
}

pub(crate) fn build(yaml: &str) -> Out {
    let store = store_from(yaml);
    let snap = build_snapshot(&store, &Snapshot::default(), &ModelOptions::default());
    let mut workloads = BTreeMap::new();
    let mut services = BTreeMap::new();
    for (name, r) in &snap.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name {
        assert_eq!(r.body.type_url, ambit_proto::ADDRESS_TYPE_URL);
        match Address::decode(r.body.value.as_slice())
            .unwrap()
            .r#type
            .unwrap()
        {
            address::Type::Workload(w) => {
                assert_eq!(&w.uid, name);
                workloads.insert(name.clone(), w);
            }
            address::Type::Service(s) => {
                assert_eq!(name, &format!("{}/{}", s.namespace, s.hostname));
                services.insert(name.clone(), s);
            }
        }
    }
    let policies = snap
        .mesh(ambit_proto::AUTHORIZATION_TYPE_URL)
        .by_name
        .iter()
        .map(|(n, r)| {
            (
                n.clone(),
                Authorization::decode(r.body.value.as_slice()).unwrap(),
            )
        })
        .collect();
    Out {
        snap,
        workloads,
        services,
        policies,
    }
}

pub(crate) fn ns(name: &str, labels: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n  labels: {{{labels}}}\n"
    )
}

pub(crate) fn pod(ns: &str, name: &str, ip: &str, labels: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{{labels}}}\nspec:\n  nodeName: node1\n  containers:\n  - name: app\n    ports:\n    - name: http\n      containerPort: 8080\nstatus:\n  podIP: {ip}\n"
    )
}

pub(crate) fn svc(ns: &str, name: &str, ip: &str, selector: &str, target: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n  clusterIP: {ip}\n  selector: {{{selector}}}\n  ports:\n  - name: http\n    port: 80\n    targetPort: {target}\n"
    )
}

pub(crate) fn uid(ns: &str, name: &str) -> String {
    format!("Kubernetes//Pod/{ns}/{name}")
}

fn ports(list: &[(u32, u32)]) -> Vec<Port> {
    list.iter()
        .map(|&(s, t)| Port {
            service_port: s,
            target_port: t,
        })
        .collect()
}

pub(crate) fn waypoint_host(w: &Option<GatewayAddress>) -> Option<(String, String, u32)> {
    let w = w.as_ref()?;
    match w.destination.as_ref()? {
        gateway_address::Destination::Hostname(h) => {
            Some((h.namespace.clone(), h.hostname.clone(), w.hbone_mtls_port))
        }
        gateway_address::Destination::Address(_) => None,
    }
}

#[test]
fn enrollment_table() {
    // (namespace labels, pod labels, pod annotations, expected HBONE)
    let cases = [
        ("istio.io/dataplane-mode: ambient", "app: a", "", true),
        (
            "istio.io/dataplane-mode: ambient",
            "istio.io/dataplane-mode: none",
            "",
            false,
        ),
        ("", "app: a", "", false),
        ("", "istio.io/dataplane-mode: ambient", "", true),
        (
            "istio.io/dataplane-mode: none",
            "istio.io/dataplane-mode: ambient",
            "",
            true,
        ),
        (
            "istio.io/dataplane-mode: ambient",
            "",
            "sidecar.istio.io/status: x",
            false,
        ),
        // Istio's tunnel label: the pod terminates HBONE itself (a sidecar
        // with HBONE, outside any ambient namespace).
        (
            "",
            "networking.istio.io/tunnel: http",
            "sidecar.istio.io/status: x",
            true,
        ),
        ("", "networking.istio.io/tunnel: h3", "", false),
    ];
    for (i, (nsl, pl, ann, hbone)) in cases.into_iter().enumerate() {
        let mut yaml = ns("a", nsl) + &pod("a", "p", "10.0.0.1", pl);
        if !ann.is_empty() {
            yaml = yaml.replace("  labels:", &format!("  annotations: {{{ann}}}\n  labels:"));
        }
        let out = build(&yaml);
        let w = &out.workloads[&uid("a", "p")];
        let want = if hbone {
            TunnelProtocol::Hbone
        } else {
            TunnelProtocol::None
        };
        assert_eq!(
            w.tunnel_protocol, want as i32,
            "case {i}: ns {{{nsl}}} pod {{{pl}}}"
        );
    }
}

#[test]
fn pod_workload_fields() {
    let yaml = ns("shop", "istio.io/dataplane-mode: ambient")
        + "---
apiVersion: v1
kind: Pod
metadata:
  name: web-7d4b9c8f6-x2x9z
  namespace: shop
  labels: {app: web, version: v2, pod-template-hash: 7d4b9c8f6}
spec:
  nodeName: node-7
  serviceAccountName: web-sa
status:
  phase: Running
  podIP: 10.1.0.5
  podIPs: [{ip: 10.1.0.5}, {ip: 'fd00::5'}]
  conditions: [{type: Ready, status: 'True'}]
";
    let out = build(&yaml);
    let w = &out.workloads[&uid("shop", "web-7d4b9c8f6-x2x9z")];
    assert_eq!(w.name, "web-7d4b9c8f6-x2x9z");
    assert_eq!(w.namespace, "shop");
    assert_eq!(
        w.addresses,
        vec![
            vec![10, 1, 0, 5],
            "fd00::5"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets()
                .to_vec()
        ]
    );
    assert_eq!(w.service_account, "web-sa");
    assert_eq!(w.node, "node-7");
    assert_eq!(w.trust_domain, "cluster.local");
    assert_eq!(w.cluster_id, "Kubernetes");
    assert_eq!(w.canonical_name, "web");
    assert_eq!(w.canonical_revision, "v2");
    assert_eq!(w.workload_name, "web");
    assert_eq!(
        w.workload_type,
        ambit_proto::workload::WorkloadType::Pod as i32
    );
    assert_eq!(w.status, WorkloadStatus::Healthy as i32);
    assert_eq!(w.tunnel_protocol, TunnelProtocol::Hbone as i32);
    let r = &out.snap.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name[&w.uid];
    assert_eq!(
        r.aliases,
        vec!["/10.1.0.5".to_string(), "/fd00::5".to_string()]
    );
    assert_eq!(
        out.snap
            .mesh(ambit_proto::ADDRESS_TYPE_URL)
            .resolve("/fd00::5"),
        Some(w.uid.as_str())
    );
}

#[test]
fn pod_status_and_defaults_table() {
    // (status yaml, spec extra, expect workload?, expect healthy, expected SA)
    let cases = [
        ("  podIP: 10.0.0.9\n", "", true, true, "default"),
        (
            "  podIP: 10.0.0.9\n  phase: Pending\n",
            "",
            true,
            false,
            "default",
        ),
        (
            "  podIP: 10.0.0.9\n  conditions: [{type: Ready, status: 'False'}]\n",
            "",
            true,
            false,
            "default",
        ),
        (
            "  podIP: 10.0.0.9\n  phase: Succeeded\n",
            "",
            false,
            false,
            "",
        ),
        ("  phase: Pending\n", "", false, false, ""),
        (
            "  podIP: 10.0.0.9\n",
            "  hostNetwork: true\n",
            false,
            false,
            "",
        ),
        (
            "  podIP: 10.0.0.9\n",
            "  serviceAccount: legacy\n",
            true,
            true,
            "legacy",
        ),
    ];
    for (i, (status, spec, exists, healthy, sa)) in cases.into_iter().enumerate() {
        let yaml = format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: p, namespace: a}}\nspec:\n  nodeName: n\n{spec}status:\n{status}"
        );
        let out = build(&yaml);
        let w = out.workloads.get(&uid("a", "p"));
        assert_eq!(w.is_some(), exists, "case {i}");
        if let Some(w) = w {
            let want = if healthy {
                WorkloadStatus::Healthy
            } else {
                WorkloadStatus::Unhealthy
            };
            assert_eq!(w.status, want as i32, "case {i}");
            assert_eq!(w.service_account, sa, "case {i}");
            assert_eq!(
                w.canonical_name, "p",
                "case {i}: falls back to the workload name"
            );
            assert_eq!(w.canonical_revision, "latest", "case {i}");
        }
    }
}

#[test]
fn waypoint_table() {
    // (ns labels, pod labels, service labels, pod waypoint, service waypoint)
    type Wp = Option<(&'static str, &'static str)>;
    let cases: [(&str, &str, &str, Wp, Wp); 6] = [
        ("", "", "", None, None),
        (
            "istio.io/use-waypoint: wp",
            "",
            "",
            Some(("a", "wp.a.svc.cluster.local")),
            Some(("a", "wp.a.svc.cluster.local")),
        ),
        (
            "istio.io/use-waypoint: wp",
            "istio.io/use-waypoint: none",
            "istio.io/use-waypoint: none",
            None,
            None,
        ),
        (
            "",
            "istio.io/use-waypoint: pw",
            "istio.io/use-waypoint: sw",
            Some(("a", "pw.a.svc.cluster.local")),
            Some(("a", "sw.a.svc.cluster.local")),
        ),
        (
            "istio.io/use-waypoint: wp",
            "istio.io/use-waypoint: pw, istio.io/use-waypoint-namespace: infra",
            "",
            Some(("infra", "pw.infra.svc.cluster.local")),
            Some(("a", "wp.a.svc.cluster.local")),
        ),
        (
            "istio.io/use-waypoint: wp",
            "gateway.networking.k8s.io/gateway-name: wp",
            "",
            None,
            Some(("a", "wp.a.svc.cluster.local")),
        ),
    ];
    for (i, (nsl, pl, sl, pw, sw)) in cases.into_iter().enumerate() {
        let service = svc("a", "s", "10.96.0.1", "app: x", "80").replace(
            "  namespace: a\nspec:",
            &format!("  namespace: a\n  labels: {{{sl}}}\nspec:"),
        );
        let yaml = ns("a", nsl) + &pod("a", "p", "10.0.0.1", pl) + &service;
        let out = build(&yaml);
        let conv = |w: Wp| w.map(|(n, h)| (n.to_string(), h.to_string(), 15008));
        assert_eq!(
            waypoint_host(&out.workloads[&uid("a", "p")].waypoint),
            conv(pw),
            "case {i} pod"
        );
        assert_eq!(
            waypoint_host(&out.services["a/s.a.svc.cluster.local"].waypoint),
            conv(sw),
            "case {i} service"
        );
    }
}

#[test]
fn service_ports_and_named_target_ports() {
    let yaml = pod("a", "p1", "10.0.0.1", "app: web")
        + &pod("a", "p2", "10.0.0.2", "app: web").replace("name: http\n", "name: web\n")
        + &svc("a", "named", "10.96.0.1", "app: web", "http")
        + &svc("a", "num", "10.96.0.2", "app: web", "9090");
    let out = build(&yaml);
    let named = &out.services["a/named.a.svc.cluster.local"];
    assert_eq!(
        named.ports,
        ports(&[(80, 0)]),
        "named targetPort is resolved per workload"
    );
    assert_eq!(named.hostname, "named.a.svc.cluster.local");
    assert_eq!(named.addresses.len(), 1);
    assert_eq!(named.addresses[0].address, vec![10, 96, 0, 1]);
    let num = &out.services["a/num.a.svc.cluster.local"];
    assert_eq!(num.ports, ports(&[(80, 9090)]));
    let p1 = &out.workloads[&uid("a", "p1")];
    assert_eq!(
        p1.services["a/named.a.svc.cluster.local"].ports,
        ports(&[(80, 8080)])
    );
    assert_eq!(
        p1.services["a/num.a.svc.cluster.local"].ports,
        ports(&[(80, 9090)])
    );
    // p2 has no container port named "http": not an endpoint of that port.
    let p2 = &out.workloads[&uid("a", "p2")];
    assert!(!p2.services.contains_key("a/named.a.svc.cluster.local"));
    assert_eq!(
        p2.services["a/num.a.svc.cluster.local"].ports,
        ports(&[(80, 9090)])
    );
    let aliases =
        &out.snap.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name["a/named.a.svc.cluster.local"]
            .aliases;
    assert_eq!(aliases, &vec!["/10.96.0.1".to_string()]);
}

#[test]
fn membership_table() {
    // Each case: extra objects; expected members of a/s.a.svc.cluster.local
    // as (workload uid, ports).
    let base = pod("a", "a1", "10.0.0.1", "app: a")
        + &pod("a", "a2", "10.0.0.2", "app: a")
        + &pod("a", "b1", "10.0.0.3", "app: b")
        + &pod("other", "a3", "10.0.0.4", "app: a");
    let slice = |body: &str| {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: s-abc\n  namespace: a\n  labels: {{kubernetes.io/service-name: s}}\naddressType: IPv4\n{body}"
        )
    };
    type Members = Vec<(String, Vec<(u32, u32)>)>;
    let cases: Vec<(String, Members)> = vec![
        // Selector only: same-namespace pods with matching labels.
        (
            svc("a", "s", "10.96.0.1", "app: a", "8080"),
            vec![
                (uid("a", "a1"), vec![(80, 8080)]),
                (uid("a", "a2"), vec![(80, 8080)]),
            ],
        ),
        // No selector, no slices: no endpoints.
        (svc("a", "s", "10.96.0.1", "", "8080"), vec![]),
        // Slices win over the selector; targetRef and IP both match pods;
        // the slice port (by name) gives the target port.
        (
            svc("a", "s", "10.96.0.1", "app: a", "8080")
                + &slice(
                    "endpoints:\n- addresses: [10.0.0.3]\n  targetRef: {kind: Pod, name: b1}\n- addresses: [10.0.0.2]\nports:\n- name: http\n  port: 7070\n",
                ),
            vec![
                (uid("a", "a2"), vec![(80, 7070)]),
                (uid("a", "b1"), vec![(80, 7070)]),
            ],
        ),
        // An address without a pod gets a workload of its own.
        (
            svc("a", "s", "10.96.0.1", "", "8080")
                + &slice(
                    "endpoints:\n- addresses: [192.168.1.1]\n  conditions: {ready: true}\nports:\n- name: http\n  port: 9000\n",
                ),
            vec![(
                "Kubernetes/discovery.k8s.io/EndpointSlice/a/s-abc/192.168.1.1".to_string(),
                vec![(80, 9000)],
            )],
        ),
        // Empty slice (endpoints: null): the service has no endpoints, even with a selector.
        (
            svc("a", "s", "10.96.0.1", "app: a", "8080") + &slice("endpoints: null\n"),
            vec![],
        ),
    ];
    for (i, (extra, want)) in cases.into_iter().enumerate() {
        let out = build(&(base.clone() + &extra));
        let key = "a/s.a.svc.cluster.local";
        let got: Members = out
            .workloads
            .values()
            .filter_map(|w| {
                let pl = w.services.get(key)?;
                Some((
                    w.uid.clone(),
                    pl.ports
                        .iter()
                        .map(|p| (p.service_port, p.target_port))
                        .collect(),
                ))
            })
            .collect();
        assert_eq!(got, want, "case {i}");
    }
}

#[test]
fn headless_service_has_no_addresses() {
    let out = build(&svc("a", "h", "None", "app: a", "80"));
    let s = &out.services["a/h.a.svc.cluster.local"];
    assert!(s.addresses.is_empty());
    assert!(
        out.snap.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name["a/h.a.svc.cluster.local"]
            .aliases
            .is_empty()
    );
}

#[test]
fn service_entry_hosts_addresses_ports_and_endpoints() {
    let yaml = ns("ext", "istio.io/dataplane-mode: ambient")
        + "---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: db, namespace: ext}
spec:
  hosts: [db.example.com, db2.example.com]
  addresses: [240.240.0.1, 10.10.0.0/16, '240.240.0.2/32']
  location: MESH_INTERNAL
  resolution: STATIC
  ports:
  - {number: 5432, name: tcp-pg, protocol: TCP, targetPort: 6432}
  - {number: 80, name: http, protocol: HTTP}
  endpoints:
  - address: 10.20.0.1
    labels: {app: pg}
    serviceAccount: pg-sa
    ports: {http: 8080}
  - address: 10.20.0.2
    network: net2
  - address: pg.internal.example
";
    let out = build(&yaml);
    for host in ["db.example.com", "db2.example.com"] {
        let s = &out.services[&format!("ext/{host}")];
        assert_eq!(s.name, "db");
        assert_eq!(s.namespace, "ext");
        assert_eq!(s.hostname, host);
        let addrs: Vec<Vec<u8>> = s.addresses.iter().map(|a| a.address.clone()).collect();
        assert_eq!(
            addrs,
            vec![vec![240, 240, 0, 1], vec![240, 240, 0, 2]],
            "CIDRs are skipped, /32 accepted"
        );
        assert_eq!(s.ports, ports(&[(5432, 6432), (80, 80)]));
    }
    let w1 = &out.workloads["Kubernetes/networking.istio.io/ServiceEntry/ext/db/10.20.0.1"];
    assert_eq!(w1.service_account, "pg-sa");
    assert_eq!(w1.canonical_name, "pg");
    assert_eq!(w1.tunnel_protocol, TunnelProtocol::Hbone as i32);
    assert_eq!(
        w1.services["ext/db.example.com"].ports,
        ports(&[(5432, 6432), (80, 8080)])
    );
    assert_eq!(
        w1.services["ext/db2.example.com"].ports,
        ports(&[(5432, 6432), (80, 8080)])
    );
    let w2 = &out.workloads["Kubernetes/networking.istio.io/ServiceEntry/ext/db/10.20.0.2"];
    assert_eq!(w2.network, "net2");
    assert_eq!(w2.service_account, "default");
    assert_eq!(
        w2.services["ext/db.example.com"].ports,
        ports(&[(5432, 6432), (80, 80)])
    );
    assert_eq!(
        out.workloads.len(),
        2,
        "the DNS-name endpoint has no workload"
    );
    // aliases of the address resources
    let r = &out.snap.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name["ext/db.example.com"];
    assert_eq!(
        r.aliases,
        vec!["/240.240.0.1".to_string(), "/240.240.0.2".to_string()]
    );
}

#[test]
fn service_entry_selector_and_workload_entry() {
    let yaml = ns("vm", "")
        + &pod("vm", "p", "10.0.0.1", "app: api")
        + "---
apiVersion: networking.istio.io/v1beta1
kind: WorkloadEntry
metadata: {name: vm1, namespace: vm, labels: {version: v3}}
spec:
  address: 172.16.0.9
  labels: {app: api, istio.io/dataplane-mode: ambient}
  serviceAccount: vm-sa
  network: vmnet
  ports: {http: 8443}
---
apiVersion: networking.istio.io/v1alpha3
kind: WorkloadEntry
metadata: {name: dns, namespace: vm}
spec:
  address: vm.example.com
---
apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: vm2, namespace: vm, labels: {networking.istio.io/tunnel: http}}
spec: {address: 172.16.0.10}
---
apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: vm3, namespace: vm}
spec: {address: 172.16.0.11}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: api, namespace: vm}
spec:
  hosts: [api.vm.internal]
  ports: [{number: 443, name: http, targetPort: 9443}]
  workloadSelector: {labels: {app: api}}
" + &svc("vm", "k8s-api", "10.96.1.1", "app: api", "http");
    let out = build(&yaml);
    let we = &out.workloads["Kubernetes/networking.istio.io/WorkloadEntry/vm/vm1"];
    assert_eq!(we.name, "vm1");
    assert_eq!(we.addresses, vec![vec![172, 16, 0, 9]]);
    assert_eq!(we.service_account, "vm-sa");
    assert_eq!(we.network, "vmnet");
    assert_eq!(we.canonical_name, "api");
    assert_eq!(
        we.canonical_revision, "v3",
        "metadata labels back the spec labels"
    );
    assert_eq!(we.tunnel_protocol, TunnelProtocol::Hbone as i32);
    let tunnel = |name: &str| {
        out.workloads[&format!("Kubernetes/networking.istio.io/WorkloadEntry/vm/{name}")]
            .tunnel_protocol
    };
    assert_eq!(
        tunnel("vm2"),
        TunnelProtocol::Hbone as i32,
        "Istio's tunnel label"
    );
    assert_eq!(
        tunnel("vm3"),
        TunnelProtocol::None as i32,
        "not ambient, no label"
    );
    assert_eq!(
        we.services["vm/api.vm.internal"].ports,
        ports(&[(443, 8443)]),
        "WorkloadEntry port by name wins"
    );
    assert_eq!(
        we.services["vm/k8s-api.vm.svc.cluster.local"].ports,
        ports(&[(80, 8443)])
    );
    let p = &out.workloads[&uid("vm", "p")];
    assert_eq!(
        p.services["vm/api.vm.internal"].ports,
        ports(&[(443, 9443)])
    );
    assert_eq!(
        p.services["vm/k8s-api.vm.svc.cluster.local"].ports,
        ports(&[(80, 8080)])
    );
    assert!(
        !out.workloads
            .contains_key("Kubernetes/networking.istio.io/WorkloadEntry/vm/dns"),
        "a WorkloadEntry with a DNS address has no workload"
    );
    let r = &out.snap.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name[&we.uid];
    assert_eq!(r.aliases, vec!["vmnet/172.16.0.9".to_string()]);
}

#[test]
fn workload_names_table() {
    // (pod name, labels, owner references yaml, expected workload_name)
    let cases = [
        (
            "web-5d8f7c6b9-abcde",
            "pod-template-hash: 5d8f7c6b9",
            "",
            "web",
        ),
        (
            "web-5d8f7c6b9-abcde",
            "pod-template-hash: 5d8f7c6b9",
            "[{kind: ReplicaSet, name: web-5d8f7c6b9, controller: true}]",
            "web",
        ),
        (
            "db-0",
            "",
            "[{kind: StatefulSet, name: db, controller: true}]",
            "db",
        ),
        ("plain", "", "", "plain"),
        ("odd-name", "pod-template-hash: zzz", "", "odd-name"),
    ];
    for (i, (name, labels, owners, want)) in cases.into_iter().enumerate() {
        let mut yaml = pod("a", name, "10.0.0.1", labels);
        if !owners.is_empty() {
            yaml = yaml.replace(
                "  namespace: a\n",
                &format!("  namespace: a\n  ownerReferences: {owners}\n"),
            );
        }
        let out = build(&yaml);
        assert_eq!(
            out.workloads[&uid("a", name)].workload_name,
            want,
            "case {i}"
        );
    }
}

#[test]
fn encoding_is_deterministic_and_deltas_exact() {
    let mut yaml = pod("a", "p", "10.0.0.1", "app: web");
    for i in 0..8 {
        yaml += &svc(
            "a",
            &format!("s{i}"),
            &format!("10.96.0.{}", i + 1),
            "app: web",
            "http",
        );
    }
    let store = store_from(&yaml);
    let opts = ModelOptions::default();
    let s1 = build_snapshot(&store, &Snapshot::default(), &opts);
    assert_eq!(s1.seq, 1);
    assert_eq!(
        s1.mesh_delta(ambit_proto::ADDRESS_TYPE_URL).changed.len(),
        9
    );
    let w = Address::decode(
        s1.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name[&uid("a", "p")]
            .body
            .value
            .as_slice(),
    )
    .unwrap();
    let Some(address::Type::Workload(w)) = w.r#type else {
        panic!("not a workload")
    };
    assert_eq!(w.services.len(), 8);
    for _ in 0..5 {
        let s2 = build_snapshot(&store, &s1, &opts);
        assert_eq!(s2.seq, 2);
        assert!(
            s2.mesh_delta(ambit_proto::ADDRESS_TYPE_URL).is_empty(),
            "rebuilding unchanged config yields no delta: {:?}",
            s2.mesh_delta(ambit_proto::ADDRESS_TYPE_URL)
        );
        for (name, r) in &s2.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name {
            assert!(
                std::sync::Arc::ptr_eq(r, &s1.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name[name]),
                "{name} keeps its Arc"
            );
        }
    }
    // One pod changes: exactly its workload is in the delta; a pod and a
    // service disappear: exactly they are removed.
    let yaml2 = yaml
        .replace("10.0.0.1", "10.0.0.7")
        .replace("name: s7\n", "name: gone\n");
    let store2 = store_from(&yaml2);
    let s3 = build_snapshot(&store2, &s1, &opts);
    let changed: Vec<&str> = s3
        .mesh_delta(ambit_proto::ADDRESS_TYPE_URL)
        .changed
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(
        changed,
        vec!["Kubernetes//Pod/a/p", "a/gone.a.svc.cluster.local"]
    );
    let removed: Vec<&str> = s3
        .mesh_delta(ambit_proto::ADDRESS_TYPE_URL)
        .removed
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(removed, vec!["a/s7.a.svc.cluster.local"]);
}

#[test]
fn large_mesh_translates() {
    // 2,000 pods / 200 services in 10 namespaces: every pod backs exactly
    // one service; checks linear-time paths give the right memberships.
    let mut objs = String::new();
    for n in 0..10 {
        objs += &ns(&format!("ns{n}"), "istio.io/dataplane-mode: ambient");
        for s in 0..20 {
            objs += &svc(
                &format!("ns{n}"),
                &format!("svc{s}"),
                &format!("10.96.{n}.{s}"),
                &format!("app: app{s}"),
                "http",
            );
            for p in 0..10 {
                objs += &pod(
                    &format!("ns{n}"),
                    &format!("app{s}-{p}"),
                    &format!("10.{n}.{s}.{p}"),
                    &format!("app: app{s}"),
                );
            }
        }
    }
    let out = build(&objs);
    assert_eq!(out.workloads.len(), 2000);
    assert_eq!(out.services.len(), 200);
    for w in out.workloads.values() {
        assert_eq!(w.services.len(), 1, "{}", w.uid);
        let app = w.name.split('-').next().unwrap();
        let key = format!(
            "{}/{}.{}.svc.cluster.local",
            w.namespace,
            app.replace("app", "svc"),
            w.namespace
        );
        assert_eq!(w.services[&key].ports, ports(&[(80, 8080)]));
    }
}
