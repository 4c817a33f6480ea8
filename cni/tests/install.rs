//! The node agent's plugin installation: binary copy, conflist insertion and
//! removal, and re-insertion while other CNIs rewrite the conf dir. Temp
//! dirs only; no root needed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ambit_cni::agent::install::{
    InsertOutcome, InstallConfig, InstallError, find_primary_conflist, insert, install_binary,
    remove, watch_and_reinsert, watch_and_reinsert_reporting,
};
use serde_json::{Value, json};
use tempfile::TempDir;

/// A kind-style bridge + host-local + portmap conflist, as a runtime has it.
const REALISTIC: &str = r#"{
  "cniVersion": "1.0.0",
  "name": "kindnet",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "mtu": 1500,
      "ipam": {
        "type": "host-local",
        "ranges": [[{ "subnet": "10.244.1.0/24", "gateway": "10.244.1.1" }]],
        "routes": [{ "dst": "0.0.0.0/0" }],
        "dataDir": "/run/cni-ipam-state"
      }
    },
    {
      "type": "portmap",
      "capabilities": { "portMappings": true },
      "snat": true
    }
  ]
}
"#;

struct Node {
    _tmp: TempDir,
    cfg: InstallConfig,
}

impl Node {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let bin = tmp.path().join("opt/cni/bin");
        let conf = tmp.path().join("etc/cni/net.d");
        fs::create_dir_all(&bin).unwrap();
        fs::create_dir_all(&conf).unwrap();
        let src = tmp.path().join("image/ambit-cni");
        fs::create_dir_all(src.parent().unwrap()).unwrap();
        fs::write(&src, b"\x7fELF plugin v1").unwrap();
        let cfg = InstallConfig {
            plugin_source: src,
            cni_bin_dir: bin,
            cni_conf_dir: conf,
            plugin_config: ours("/var/run/ambit/cni.sock"),
        };
        Self { _tmp: tmp, cfg }
    }

    fn conf(&self, name: &str) -> PathBuf {
        self.cfg.cni_conf_dir.join(name)
    }

    fn write_conf(&self, name: &str, contents: &str) -> PathBuf {
        let p = self.conf(name);
        fs::write(&p, contents).unwrap();
        p
    }
}

fn ours(socket: &str) -> Value {
    json!({"type": "ambit-cni", "ambit": {"agent_socket": socket}})
}

fn parse(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

fn plugin_types(doc: &Value) -> Vec<String> {
    doc["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["type"].as_str().unwrap_or("?").to_owned())
        .collect()
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn has_ours(path: &Path) -> bool {
    fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|d| d.get("plugins").and_then(Value::as_array).cloned())
        .is_some_and(|ps| ps.iter().any(|p| p["type"] == "ambit-cni"))
}

/// Polls `cond` until it holds or `limit` passes; returns the time taken.
async fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let start = std::time::Instant::now();
    loop {
        if cond() {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "condition not met within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[test]
fn primary_is_the_first_config_file_in_byte_order() {
    let node = Node::new();
    let dir = &node.cfg.cni_conf_dir;
    assert_eq!(find_primary_conflist(dir).unwrap(), None);
    assert_eq!(
        find_primary_conflist(&dir.join("missing")).unwrap(),
        None,
        "a conf dir that does not exist yet has no primary"
    );
    node.write_conf("99-loopback.conf", r#"{"type":"loopback"}"#);
    node.write_conf("20-b.json", "{}");
    node.write_conf("10-calico.conflist", REALISTIC);
    node.write_conf("05-old.conflist.bak", "{}");
    node.write_conf("00-kubeconfig", "x");
    node.write_conf(".00-a.conflist.ambit-tmp-1-0", "{}");
    node.write_conf("Z.CONF", "{}"); // extensions are case-sensitive
    fs::create_dir(node.conf("01-dir.conflist")).unwrap();
    assert_eq!(
        find_primary_conflist(dir).unwrap(),
        Some(node.conf("10-calico.conflist"))
    );
    node.write_conf("10-calico.conf", r#"{"type":"calico"}"#);
    assert_eq!(
        find_primary_conflist(dir).unwrap(),
        Some(node.conf("10-calico.conf")),
        "`.conf` sorts before `.conflist`"
    );
}

#[test]
fn insert_keeps_the_other_plugins_and_appends_ours_last() {
    let node = Node::new();
    let path = node.write_conf("10-kindnet.conflist", REALISTIC);
    node.write_conf("20-later.conflist", REALISTIC);
    let original: Value = serde_json::from_str(REALISTIC).unwrap();

    let outcome = insert(&node.cfg).unwrap();
    assert_eq!(outcome, InsertOutcome::Inserted(path.clone()));
    let doc = parse(&path);
    assert_eq!(plugin_types(&doc), ["bridge", "portmap", "ambit-cni"]);
    assert_eq!(doc["plugins"][0], original["plugins"][0]);
    assert_eq!(doc["plugins"][1], original["plugins"][1]);
    assert_eq!(doc["plugins"][2], node.cfg.plugin_config);
    assert_eq!(doc["cniVersion"], "1.0.0");
    assert_eq!(doc["name"], "kindnet");
    assert_eq!(doc.as_object().unwrap().len(), 3);
    assert_eq!(
        fs::read_to_string(node.conf("20-later.conflist")).unwrap(),
        REALISTIC,
        "only the primary config is touched"
    );
    assert_eq!(
        names_in(&node.cfg.cni_conf_dir),
        ["10-kindnet.conflist", "20-later.conflist"],
        "no temp files left"
    );
}

#[test]
fn insert_twice_leaves_one_entry_and_does_not_rewrite() {
    let node = Node::new();
    let path = node.write_conf("10-kindnet.conflist", REALISTIC);
    insert(&node.cfg).unwrap();
    let ino = fs::metadata(&path).unwrap().ino();
    let bytes = fs::read(&path).unwrap();

    assert_eq!(
        insert(&node.cfg).unwrap(),
        InsertOutcome::Unchanged(path.clone())
    );
    assert_eq!(fs::read(&path).unwrap(), bytes);
    assert_eq!(fs::metadata(&path).unwrap().ino(), ino, "file not replaced");
    assert_eq!(
        plugin_types(&parse(&path)),
        ["bridge", "portmap", "ambit-cni"]
    );
}

#[test]
fn insert_replaces_an_outdated_or_duplicated_entry() {
    let mut node = Node::new();
    let path = node.write_conf("10-kindnet.conflist", REALISTIC);
    insert(&node.cfg).unwrap();

    node.cfg.plugin_config = ours("/run/ambit/new.sock");
    assert_eq!(
        insert(&node.cfg).unwrap(),
        InsertOutcome::Updated(path.clone())
    );
    let doc = parse(&path);
    assert_eq!(plugin_types(&doc), ["bridge", "portmap", "ambit-cni"]);
    assert_eq!(
        doc["plugins"][2]["ambit"]["agent_socket"],
        "/run/ambit/new.sock"
    );

    // Two stale entries, one in the middle: one current entry, last.
    let mut doc: Value = serde_json::from_str(REALISTIC).unwrap();
    let plugins = doc["plugins"].as_array_mut().unwrap();
    plugins.insert(1, ours("/old/1.sock"));
    plugins.push(ours("/old/2.sock"));
    fs::write(&path, serde_json::to_vec(&doc).unwrap()).unwrap();
    assert_eq!(
        insert(&node.cfg).unwrap(),
        InsertOutcome::Updated(path.clone())
    );
    let doc = parse(&path);
    assert_eq!(plugin_types(&doc), ["bridge", "portmap", "ambit-cni"]);
    assert_eq!(doc["plugins"][2], node.cfg.plugin_config);
}

#[test]
fn remove_restores_the_original_plugins_and_the_binary() {
    let node = Node::new();
    let path = node.write_conf("10-kindnet.conflist", REALISTIC);
    fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
    let bin = install_binary(&node.cfg).unwrap();
    insert(&node.cfg).unwrap();
    // An older config still holding an entry (the primary changed since).
    let older = node.write_conf("50-old.conflist", REALISTIC);
    let mut old_doc: Value = serde_json::from_str(REALISTIC).unwrap();
    old_doc["plugins"]
        .as_array_mut()
        .unwrap()
        .push(ours("/x.sock"));
    fs::write(&older, old_doc.to_string()).unwrap();

    assert!(remove(&node.cfg).unwrap());
    let original: Value = serde_json::from_str(REALISTIC).unwrap();
    assert_eq!(parse(&path), original);
    assert_eq!(parse(&older), original);
    assert_eq!(
        fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o640,
        "the file keeps its mode"
    );
    assert!(!bin.exists());

    assert!(!remove(&node.cfg).unwrap(), "nothing left to remove");
    assert_eq!(parse(&path), original);
}

#[test]
fn a_single_plugin_conf_becomes_a_conflist_with_the_same_name() {
    let node = Node::new();
    let single = json!({
        "cniVersion": "0.4.0",
        "name": "mynet",
        "type": "bridge",
        "bridge": "cni0",
        "ipam": {"type": "host-local", "subnet": "10.22.0.0/16"}
    });
    let conf = node.write_conf("10-mynet.conf", &single.to_string());
    let list = node.conf("10-mynet.conflist");

    assert_eq!(
        insert(&node.cfg).unwrap(),
        InsertOutcome::Inserted(list.clone())
    );
    assert!(!conf.exists(), "the .conf is replaced by the .conflist");
    let doc = parse(&list);
    assert_eq!(
        doc,
        json!({
            "cniVersion": "0.4.0",
            "name": "mynet",
            "plugins": [single, node.cfg.plugin_config],
        })
    );
    assert_eq!(
        find_primary_conflist(&node.cfg.cni_conf_dir).unwrap(),
        Some(list.clone())
    );
    assert_eq!(
        insert(&node.cfg).unwrap(),
        InsertOutcome::Unchanged(list.clone())
    );

    // The primary CNI writes its .conf again: converted again, over ours.
    fs::write(&conf, single.to_string()).unwrap();
    assert_eq!(
        insert(&node.cfg).unwrap(),
        InsertOutcome::Inserted(list.clone())
    );
    assert_eq!(names_in(&node.cfg.cni_conf_dir), ["10-mynet.conflist"]);

    // Removal keeps the (equivalent) list with the one original plugin.
    assert!(remove(&node.cfg).unwrap());
    assert_eq!(
        parse(&list),
        json!({"cniVersion": "0.4.0", "name": "mynet", "plugins": [single]})
    );
}

#[test]
fn a_config_that_is_not_json_is_left_untouched_and_reported() {
    let node = Node::new();
    let broken =
        "{\n  \"cniVersion\": \"1.0.0\",\n  \"plugins\": [ {\"type\": \"bridge\",, } ]\n}\n";
    let path = node.write_conf("10-broken.conflist", broken);
    node.write_conf("20-fine.conflist", REALISTIC);

    let err = insert(&node.cfg).unwrap_err();
    assert!(
        matches!(&err, InstallError::NotJson { path: p, line: 3, .. } if *p == path),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("10-broken.conflist"), "{msg}");
    assert!(msg.contains("not valid JSON at line 3"), "{msg}");
    assert!(msg.contains("left untouched"), "{msg}");
    assert_eq!(fs::read_to_string(&path).unwrap(), broken);
    assert_eq!(
        fs::read_to_string(node.conf("20-fine.conflist")).unwrap(),
        REALISTIC,
        "no other file is used instead: the runtime would not either"
    );

    let err = remove(&node.cfg).unwrap_err();
    assert!(matches!(err, InstallError::NotJson { .. }), "{err:?}");
    assert_eq!(fs::read_to_string(&path).unwrap(), broken);
}

#[test]
fn configs_that_are_json_but_not_network_lists_are_reported() {
    let node = Node::new();
    for (contents, problem) in [
        (
            r#"{"cniVersion":"1.0.0","name":"x"}"#,
            "no \"plugins\" array",
        ),
        (
            r#"{"name":"x","plugins":{"type":"bridge"}}"#,
            "\"plugins\" is an object, not an array",
        ),
        ("[1, 2]", "the top level is an array"),
        (
            r#"{"name":"x","plugins":[]}"#,
            "the \"plugins\" array is empty",
        ),
        (
            r#"{"name":"x","plugins":[{"type":"ambit-cni"}]}"#,
            "its only plugin is ambit-cni",
        ),
    ] {
        let path = node.write_conf("10-x.conflist", contents);
        let err = insert(&node.cfg).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, InstallError::BadConfig { .. }), "{msg}");
        assert!(msg.contains(problem), "{msg}");
        assert!(msg.contains("10-x.conflist"), "{msg}");
        assert_eq!(fs::read_to_string(&path).unwrap(), contents);
    }
    fs::remove_file(node.conf("10-x.conflist")).unwrap();
    let path = node.write_conf("10-x.conf", r#"{"name":"x"}"#);
    let msg = insert(&node.cfg).unwrap_err().to_string();
    assert!(msg.contains("neither a \"type\""), "{msg}");
    assert!(path.exists());
}

#[test]
fn no_config_at_all_is_an_error_for_insert_and_nothing_for_remove() {
    let node = Node::new();
    let err = insert(&node.cfg).unwrap_err();
    assert!(
        matches!(&err, InstallError::NoPrimaryConfig { dir } if *dir == node.cfg.cni_conf_dir),
        "{err:?}"
    );
    assert!(err.to_string().contains("primary CNI"), "{err}");
    assert!(!remove(&node.cfg).unwrap());
    assert!(names_in(&node.cfg.cni_conf_dir).is_empty());
}

#[test]
fn a_plugin_config_that_is_not_ours_is_refused() {
    let mut node = Node::new();
    let path = node.write_conf("10-kindnet.conflist", REALISTIC);
    for bad in [
        json!({"type": "bridge"}),
        json!("ambit-cni"),
        json!({"ambit": {}}),
    ] {
        node.cfg.plugin_config = bad;
        let err = insert(&node.cfg).unwrap_err();
        assert!(matches!(err, InstallError::PluginConfig(_)), "{err:?}");
    }
    assert_eq!(fs::read_to_string(&path).unwrap(), REALISTIC);
}

#[test]
fn binary_install_is_atomic_idempotent_and_0755() {
    let node = Node::new();
    let dst = install_binary(&node.cfg).unwrap();
    assert_eq!(dst, node.cfg.cni_bin_dir.join("ambit-cni"));
    assert_eq!(fs::read(&dst).unwrap(), b"\x7fELF plugin v1");
    let meta = fs::metadata(&dst).unwrap();
    assert_eq!(meta.permissions().mode() & 0o7777, 0o755);

    // Identical: not copied again (same inode); a wrong mode is fixed.
    fs::set_permissions(&dst, fs::Permissions::from_mode(0o700)).unwrap();
    install_binary(&node.cfg).unwrap();
    let again = fs::metadata(&dst).unwrap();
    assert_eq!(again.ino(), meta.ino());
    assert_eq!(again.permissions().mode() & 0o7777, 0o755);

    // A new version replaces the file by rename: an open handle (a running
    // plugin) keeps the old contents, nothing is written in place.
    let old = fs::File::open(&dst).unwrap();
    fs::write(&node.cfg.plugin_source, b"\x7fELF plugin v2, longer").unwrap();
    install_binary(&node.cfg).unwrap();
    assert_eq!(fs::read(&dst).unwrap(), b"\x7fELF plugin v2, longer");
    assert_ne!(fs::metadata(&dst).unwrap().ino(), meta.ino());
    assert_eq!(
        std::io::read_to_string(old).unwrap(),
        "\x7fELF plugin v1",
        "the old binary was not modified"
    );
    assert_eq!(
        fs::metadata(&dst).unwrap().permissions().mode() & 0o7777,
        0o755
    );
    assert_eq!(
        names_in(&node.cfg.cni_bin_dir),
        ["ambit-cni"],
        "no temp files"
    );

    let mut missing = node.cfg.clone();
    missing.plugin_source = node.cfg.plugin_source.with_file_name("nope");
    let err = install_binary(&missing).unwrap_err();
    assert!(matches!(err, InstallError::Source { .. }), "{err:?}");
    assert!(err.to_string().contains("nope"), "{err}");
}

#[test]
fn a_missing_bin_dir_is_created_when_its_parent_exists() {
    let mut node = Node::new();
    // A node whose CNI is not installed yet: /opt/cni exists, bin does not.
    node.cfg.cni_bin_dir = node.cfg.cni_bin_dir.with_file_name("bin-later");
    let dst = install_binary(&node.cfg).unwrap();
    assert_eq!(dst, node.cfg.cni_bin_dir.join("ambit-cni"));
    let meta = fs::metadata(&node.cfg.cni_bin_dir).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.permissions().mode() & 0o7777, 0o755);
    assert_eq!(fs::read(&dst).unwrap(), b"\x7fELF plugin v1");
    // Idempotent.
    install_binary(&node.cfg).unwrap();
}

#[test]
fn a_bin_dir_whose_parent_is_missing_too_is_an_error_naming_the_flag() {
    let mut node = Node::new();
    let root = node.cfg.cni_bin_dir.parent().unwrap().join("nowhere");
    node.cfg.cni_bin_dir = root.join("bin");
    let err = install_binary(&node.cfg).unwrap_err();
    assert!(
        matches!(&err, InstallError::BinDirMissing { dir, parent } if *dir == node.cfg.cni_bin_dir && *parent == root),
        "{err:?}"
    );
    let msg = err.to_string();
    for part in ["--cni-bin-dir", "--no-install", "/opt/cni/bin"] {
        assert!(msg.contains(part), "{part} in {msg}");
    }
    assert!(!root.exists(), "nothing was created");

    // A file where the directory should be.
    let file = node.cfg.plugin_source.with_file_name("a-file");
    fs::write(&file, "").unwrap();
    node.cfg.cni_bin_dir = file;
    let err = install_binary(&node.cfg).unwrap_err();
    assert!(matches!(err, InstallError::Write { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_reports_when_the_plugin_is_chained() {
    let mut node = Node::new();
    node.cfg.cni_conf_dir = node.cfg.cni_conf_dir.join("later");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (tx, mut chained) = tokio::sync::watch::channel(None);
    let task = tokio::spawn(watch_and_reinsert_reporting(node.cfg.clone(), stopped, tx));
    // Nothing to chain into: it keeps trying, and says so.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(*chained.borrow(), None);
    assert!(!task.is_finished(), "the watch keeps running");

    fs::create_dir(&node.cfg.cni_conf_dir).unwrap();
    let path = node.write_conf("10-kindnet.conflist", REALISTIC);
    let got = tokio::time::timeout(Duration::from_secs(5), chained.wait_for(Option::is_some))
        .await
        .expect("chained within 5 s")
        .unwrap()
        .clone();
    assert_eq!(got, Some(path.clone()));
    assert!(has_ours(&path));

    // The config goes away: reported as not chained.
    fs::remove_file(&path).unwrap();
    tokio::time::timeout(Duration::from_secs(5), chained.wait_for(Option::is_none))
        .await
        .expect("reported within 5 s")
        .unwrap();

    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("the watch ends on shutdown")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_reinserts_when_another_cni_rewrites_or_replaces_the_file() {
    let node = Node::new();
    let path = node.write_conf("10-kindnet.conflist", REALISTIC);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(watch_and_reinsert(node.cfg.clone(), stopped));
    let limit = Duration::from_secs(2);

    let t = wait_for(limit, || has_ours(&path)).await;
    eprintln!("initial insert: {t:?}");

    // Another CNI rewrites its file in place, without us.
    fs::write(&path, REALISTIC).unwrap();
    let t = wait_for(limit, || has_ours(&path)).await;
    eprintln!("re-inserted after an in-place rewrite: {t:?}");

    // ... or writes a temp file and renames it over the config.
    let tmp = node.conf(".tmp-kindnet");
    fs::write(&tmp, REALISTIC).unwrap();
    fs::rename(&tmp, &path).unwrap();
    let t = wait_for(limit, || has_ours(&path)).await;
    eprintln!("re-inserted after a rename: {t:?}");
    assert_eq!(
        plugin_types(&parse(&path)),
        ["bridge", "portmap", "ambit-cni"]
    );

    // A new primary config appears (sorts first).
    let newer = node.write_conf("05-cilium.conflist", REALISTIC);
    let t = wait_for(limit, || has_ours(&newer)).await;
    eprintln!("inserted into a new primary: {t:?}");

    // Broken, then fixed: left alone, then inserted.
    fs::write(&newer, "{ not json").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(fs::read_to_string(&newer).unwrap(), "{ not json");
    fs::write(&newer, REALISTIC).unwrap();
    wait_for(limit, || has_ours(&newer)).await;

    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("the watch ends on shutdown")
        .unwrap();

    // Stopped: no more re-inserts.
    fs::write(&newer, REALISTIC).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!has_ours(&newer));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_waits_for_a_conf_dir_that_does_not_exist_yet() {
    let mut node = Node::new();
    node.cfg.cni_conf_dir = node.cfg.cni_conf_dir.join("later");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(watch_and_reinsert(node.cfg.clone(), stopped));

    tokio::time::sleep(Duration::from_millis(200)).await;
    fs::create_dir(&node.cfg.cni_conf_dir).unwrap();
    let path = node.write_conf("10-kindnet.conflist", REALISTIC);
    // Polled (1 s) until the directory can be watched.
    let t = wait_for(Duration::from_secs(3), || has_ours(&path)).await;
    eprintln!("inserted after the conf dir appeared: {t:?}");

    // From then on it is watched.
    fs::write(&path, REALISTIC).unwrap();
    let t = wait_for(Duration::from_secs(2), || has_ours(&path)).await;
    eprintln!("re-inserted: {t:?}");

    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("the watch ends on shutdown")
        .unwrap();
}
