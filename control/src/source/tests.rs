//! File source tests: the inotify watcher end to end (the reader itself is
//! tested in `ambit-config`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::timeout;

use ambit_config::objects::Kind;

use super::*;

fn pod(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: a\nstatus:\n  podIP: {ip}\n"
    )
}

async fn recv(rx: &mut mpsc::Receiver<SourceUpdate>) -> SourceUpdate {
    timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("an update within 10s")
        .expect("source still running")
}

fn summary(u: &SourceUpdate) -> Vec<String> {
    let mut v: Vec<String> = u
        .changes
        .iter()
        .map(|c| match c {
            Change::Upsert(o) => format!("+{}", o.key()),
            Change::Delete(k) => format!("-{k}"),
        })
        .collect();
    v.sort();
    v
}

fn ip_of(u: &SourceUpdate, name: &str) -> Option<String> {
    u.changes.iter().find_map(|c| match c {
        Change::Upsert(Object::Pod(p)) if p.metadata.name == name => {
            p.status.pod_ip.map(|i| i.to_string())
        }
        _ => None,
    })
}

fn errors_for<'u>(u: &'u SourceUpdate, file: &Path) -> Option<&'u Vec<ConfigError>> {
    let f = file.display().to_string();
    u.errors.iter().find(|(s, _)| *s == f).map(|(_, e)| e)
}

/// Writes via a temp file + rename so the watcher never sees a half file.
fn write(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn file_source_follows_edits() {
    let dir = tempfile::tempdir().unwrap();
    let root = std::path::absolute(dir.path()).unwrap();
    let a = root.join("a.yaml");
    std::fs::create_dir(root.join("sub")).unwrap();
    let b = root.join("sub/b.yml");
    std::fs::write(
        &a,
        format!("{}---\n{}", pod("p1", "10.0.0.1"), pod("p2", "10.0.0.2")),
    )
    .unwrap();
    std::fs::write(&b, pod("p3", "10.0.0.3")).unwrap();
    std::fs::write(root.join("notes.txt"), "not yaml").unwrap();
    std::fs::write(root.join(".hidden.yaml"), pod("hidden", "10.0.0.99")).unwrap();

    let (handle, mut rx) = ModelHandle::channel(16);
    let source = spawn_file_source(root.clone(), handle).await.unwrap();
    assert_eq!(source.dir(), root.as_path());
    let init = rx
        .try_recv()
        .expect("initial update sent before spawn returns");
    assert!(init.initial_sync_done);
    assert_eq!(init.source, FILE_SOURCE);
    assert_eq!(summary(&init), vec!["+Pod/a/p1", "+Pod/a/p2", "+Pod/a/p3"]);
    assert!(init.errors.is_empty());

    // Modify one object of a.yaml: only it is sent.
    write(
        &a,
        &format!("{}---\n{}", pod("p1", "10.0.0.11"), pod("p2", "10.0.0.2")),
    );
    let u = recv(&mut rx).await;
    assert_eq!(summary(&u), vec!["+Pod/a/p1"]);
    assert_eq!(ip_of(&u, "p1").as_deref(), Some("10.0.0.11"));
    assert!(!u.initial_sync_done);

    // A bad edit: p1 rejected (bad IP), p2 removed from the file.
    write(&a, &pod("p1", "10.0.0.300"));
    let u = recv(&mut rx).await;
    assert_eq!(
        summary(&u),
        vec!["-Pod/a/p2"],
        "p1's last good version keeps serving"
    );
    let errs = errors_for(&u, &a).expect("a.yaml's errors");
    assert_eq!(errs.len(), 1);
    assert_eq!(
        (errs[0].document, errs[0].line, errs[0].name.as_str()),
        (0, 1, "p1")
    );

    // Not even YAML: nothing is deleted, the error is replaced.
    write(
        &a,
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p1\n   namespace: [\n",
    );
    let u = recv(&mut rx).await;
    assert!(u.changes.is_empty(), "{:?}", summary(&u));
    let errs = errors_for(&u, &a).unwrap();
    assert!(
        errs[0].reason.contains("YAML syntax error"),
        "{}",
        errs[0].reason
    );
    assert_eq!(errs[0].name, "p1");

    // Fixed: the new version is sent and the errors are cleared.
    write(&a, &pod("p1", "10.0.0.12"));
    let u = recv(&mut rx).await;
    assert_eq!(summary(&u), vec!["+Pod/a/p1"]);
    assert_eq!(ip_of(&u, "p1").as_deref(), Some("10.0.0.12"));
    assert_eq!(errors_for(&u, &a), Some(&vec![]));

    // A new file in a new directory.
    std::fs::create_dir(root.join("new")).unwrap();
    write(&root.join("new/c.yaml"), &pod("p4", "10.0.0.4"));
    let u = recv(&mut rx).await;
    assert_eq!(summary(&u), vec!["+Pod/a/p4"]);

    // Deleting a file deletes its objects.
    std::fs::remove_file(&b).unwrap();
    let u = recv(&mut rx).await;
    assert_eq!(summary(&u), vec!["-Pod/a/p3"]);

    // Removing a directory deletes the objects of the files in it.
    std::fs::remove_dir_all(root.join("new")).unwrap();
    let u = recv(&mut rx).await;
    assert_eq!(summary(&u), vec!["-Pod/a/p4"]);

    // Dropping the source stops it: the channel closes.
    drop(source);
    let end = timeout(Duration::from_secs(5), async {
        while rx.recv().await.is_some() {}
    })
    .await;
    assert!(end.is_ok(), "the source's sender is dropped");
}

#[tokio::test]
async fn object_moving_between_files_is_not_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let root: PathBuf = std::path::absolute(dir.path()).unwrap();
    let (a, b) = (root.join("a.yaml"), root.join("b.yaml"));
    std::fs::write(&a, pod("p1", "10.0.0.1")).unwrap();
    let (handle, mut rx) = ModelHandle::channel(16);
    let _source = spawn_file_source(root.clone(), handle).await.unwrap();
    let init = rx.try_recv().unwrap();
    assert_eq!(summary(&init), vec!["+Pod/a/p1"]);
    // Move the object: b gets it, a loses it, in one burst.
    std::fs::write(&b, pod("p1", "10.0.0.1")).unwrap();
    std::fs::write(&a, "# moved to b.yaml\n").unwrap();
    let mut seen = Vec::new();
    // The two writes may land in one or two bursts; neither may delete p1.
    while let Ok(Some(u)) = timeout(Duration::from_millis(800), rx.recv()).await {
        seen.extend(summary(&u));
    }
    assert!(!seen.iter().any(|s| s.starts_with('-')), "{seen:?}");
    // Now a duplicate: both define p1; deleting one keeps the other's.
    std::fs::write(&a, pod("p1", "10.0.0.1")).unwrap();
    std::fs::remove_file(&b).unwrap();
    let mut seen = Vec::new();
    while let Ok(Some(u)) = timeout(Duration::from_millis(800), rx.recv()).await {
        seen.extend(summary(&u));
    }
    assert!(!seen.iter().any(|s| s.starts_with('-')), "{seen:?}");
}

#[tokio::test]
async fn spawn_errors_are_clear() {
    let (handle, _rx) = ModelHandle::channel(1);
    let err = spawn_file_source(PathBuf::from("/nonexistent/ambit-config"), handle.clone())
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("/nonexistent/ambit-config"),
        "{err}"
    );
    let f = tempfile::NamedTempFile::new().unwrap();
    let err = spawn_file_source(f.path().to_path_buf(), handle)
        .await
        .unwrap_err();
    assert!(matches!(err, FileSourceError::NotADirectory(_)), "{err}");
}

#[tokio::test]
async fn initial_errors_are_sent_and_objects_reach_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let root = std::path::absolute(dir.path()).unwrap();
    std::fs::write(root.join("good.yaml"), pod("p1", "10.0.0.1")).unwrap();
    std::fs::write(
        root.join("bad.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {clusterIP: nope}\n",
    )
    .unwrap();
    std::fs::write(root.join("binary.yaml"), [0xffu8, 0xfe, 0x00]).unwrap();
    let (model, mut snaps) = crate::model::spawn_model(crate::model::ModelOptions::default());
    let _source = spawn_file_source(root.clone(), model).await.unwrap();
    timeout(Duration::from_secs(5), snaps.wait_for(|s| s.synced))
        .await
        .unwrap()
        .unwrap();
    let s = snaps.borrow().clone();
    assert!(
        s.mesh(ambit_proto::ADDRESS_TYPE_URL)
            .by_name
            .contains_key("Kubernetes//Pod/a/p1")
    );
    let mut errs: Vec<(String, String)> = s
        .errors
        .iter()
        .map(|e| {
            (
                Path::new(&e.file)
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
                format!("{}/{}/{}", e.kind, e.namespace, e.name),
            )
        })
        .collect();
    errs.sort();
    assert_eq!(
        errs,
        vec![
            ("bad.yaml".to_string(), "Service/default/s".to_string()),
            ("binary.yaml".to_string(), "//".to_string())
        ]
    );
    assert!(
        s.errors
            .iter()
            .any(|e| e.reason.contains("not valid UTF-8"))
    );
    let _ = Kind::Pod;
}

/// A new file redefining a served pod with another IP does not replace it;
/// the conflict is a config error (served under `/debug/config_errors`)
/// naming both files.
#[tokio::test]
async fn duplicate_in_a_new_file_is_an_error_and_does_not_replace() {
    let dir = tempfile::tempdir().unwrap();
    let root = std::path::absolute(dir.path()).unwrap();
    let pods = root.join("pods.yaml");
    std::fs::write(&pods, pod("p1", "10.0.0.1")).unwrap();
    let (model, mut snaps) = crate::model::spawn_model(crate::model::ModelOptions::default());
    let _source = spawn_file_source(root.clone(), model).await.unwrap();
    timeout(Duration::from_secs(5), snaps.wait_for(|s| s.synced))
        .await
        .unwrap()
        .unwrap();
    let before =
        snaps.borrow().mesh(ambit_proto::ADDRESS_TYPE_URL).by_name["Kubernetes//Pod/a/p1"].clone();
    write(&root.join("dup.yaml"), &pod("p1", "10.0.0.9"));
    let s = timeout(
        Duration::from_secs(5),
        snaps.wait_for(|s| !s.errors.is_empty()),
    )
    .await
    .unwrap()
    .unwrap()
    .clone();
    assert_eq!(s.errors.len(), 1, "{:?}", s.errors);
    let e = &s.errors[0];
    assert!(e.file.ends_with("dup.yaml"), "{e}");
    assert!(e.reason.contains(&pods.display().to_string()), "{e}");
    assert!(
        Arc::ptr_eq(
            &s.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name["Kubernetes//Pod/a/p1"],
            &before
        ),
        "pods.yaml's p1 keeps serving"
    );
}

/// A file caught between two writes is valid YAML missing its end (here the
/// pod's IP): it must not be served. The source waits for the writer to
/// close the file and for a quiet period.
#[tokio::test]
async fn a_file_being_written_is_read_once_it_settles() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let root = std::path::absolute(dir.path()).unwrap();
    let (handle, mut rx) = ModelHandle::channel(16);
    let _source = spawn_file_source(root.clone(), handle).await.unwrap();
    let _init = rx.try_recv().unwrap();
    let full = pod("p1", "10.0.0.7");
    let (head, tail) = full.split_at(full.find("status:").unwrap());
    let mut f = std::fs::File::create(root.join("slow.yaml")).unwrap();
    f.write_all(head.as_bytes()).unwrap();
    f.flush().unwrap();
    // Longer than the old 30 ms debounce, shorter than SETTLE_OPEN.
    tokio::time::sleep(Duration::from_millis(120)).await;
    f.write_all(tail.as_bytes()).unwrap();
    drop(f);
    let u = recv(&mut rx).await;
    assert_eq!(summary(&u), vec!["+Pod/a/p1"]);
    assert_eq!(
        ip_of(&u, "p1").as_deref(),
        Some("10.0.0.7"),
        "the half-written version (no IP) was never sent"
    );
}
