//! Config-directory reader tests: document splitting, error reporting, and
//! the stateful reader's diffing of edits.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use super::*;

fn pod(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: a\nstatus:\n  podIP: {ip}\n"
    )
}

#[test]
fn split_documents_table() {
    // (text, expected (index, first content line, offset) per document)
    type Docs = Vec<(usize, usize, usize)>;
    let cases: Vec<(&str, Docs)> = vec![
        ("a: 1\n", vec![(0, 1, 0)]),
        ("---\na: 1\n---\nb: 2\n", vec![(0, 2, 1), (1, 4, 3)]),
        (
            "# header\n---\n# only comments\n---\n\nb: 2\n",
            vec![(0, 6, 4)],
        ),
        ("a: 1\n---\n---\nb: 2\n...\n", vec![(0, 1, 0), (1, 4, 3)]),
        ("a: 1\r\n--- \r\nb: 2\r\n", vec![(0, 1, 0), (1, 3, 2)]),
        ("a: |\n  ---not a marker\n----\nb: 1\n", vec![(0, 1, 0)]),
        ("--- {a: 1}\nb: 2\n", vec![(0, 1, 0)]),
        ("\u{feff}a: 1\n", vec![(0, 1, 0)]),
        ("", vec![]),
    ];
    for (i, (text, want)) in cases.into_iter().enumerate() {
        let got: Docs = split_documents(text)
            .iter()
            .map(|d| (d.index, d.line, d.offset))
            .collect();
        assert_eq!(got, want, "case {i}: {text:?}");
    }
}

#[test]
fn parse_documents_reports_where_and_what() {
    let text = format!(
        "# comment\n{}---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: ignored}}\n---\napiVersion: v1\nkind: Service\nmetadata:\n  name: bad-port\n  namespace: shop\nspec:\n  ports:\n  - port: eighty\n---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: broken\n  namespace: shop\n labels: {{}}\n---\nkind: Pod\nmetadata: {{name: nover}}\n---\n{}",
        pod("ok1", "10.0.0.1"),
        pod("ok1", "10.0.0.9"),
    );
    let (objs, errs) = parse_documents(Path::new("/cfg/app.yaml"), &text);
    let keys: Vec<String> = objs.iter().map(|o| o.key().to_string()).collect();
    assert_eq!(keys, vec!["Pod/a/ok1"]);
    let got: Vec<(usize, usize, String)> = errs
        .iter()
        .map(|e| {
            (
                e.document,
                e.line,
                format!("{}/{}/{}", e.kind, e.namespace, e.name),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (2, 14, "Service/shop/bad-port".to_string()),
            (3, 23, "Pod/shop/broken".to_string()),
            (4, 30, "Pod//nover".to_string()),
            (5, 33, "Pod/a/ok1".to_string()),
        ]
    );
    assert!(errs.iter().all(|e| e.file == "/cfg/app.yaml"));
    assert!(
        errs[0].reason.contains("spec.ports[0].port"),
        "{}",
        errs[0].reason
    );
    assert!(
        errs[0].reason.contains("at line 21 column"),
        "file line of the bad field: {}",
        errs[0].reason
    );
    assert!(
        errs[0].reason.contains("keeps serving"),
        "{}",
        errs[0].reason
    );
    assert!(
        errs[1].reason.contains("YAML syntax error"),
        "{}",
        errs[1].reason
    );
    assert!(
        errs[2].reason.contains("missing apiVersion"),
        "{}",
        errs[2].reason
    );
    assert!(
        errs[3].reason.contains("duplicate of document 0"),
        "{}",
        errs[3].reason
    );
    assert_eq!(
        errs[0].to_string().split(':').take(2).collect::<Vec<_>>(),
        vec!["/cfg/app.yaml", "14 (document 2) Service/shop/bad-port"]
    );
}

fn summary(u: &DirUpdate) -> Vec<String> {
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

fn ip_of(u: &DirUpdate, name: &str) -> Option<String> {
    u.changes.iter().find_map(|c| match c {
        Change::Upsert(Object::Pod(p)) if p.metadata.name == name => {
            p.status.pod_ip.map(|i| i.to_string())
        }
        _ => None,
    })
}

fn errors_for<'u>(u: &'u DirUpdate, file: &Path) -> Option<&'u Vec<ConfigError>> {
    let f = file.display().to_string();
    u.errors.iter().find(|(s, _)| *s == f).map(|(_, e)| e)
}

#[test]
fn reader_follows_edits_and_keeps_last_good_versions() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
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

    let mut reader = ConfigDir::new(&root);
    let init = reader.rescan();
    assert_eq!(summary(&init), vec!["+Pod/a/p1", "+Pod/a/p2", "+Pod/a/p3"]);
    assert!(init.errors.iter().all(|(_, e)| e.is_empty()));
    assert_eq!(reader.file_count(), 2);
    assert!(
        reader.rescan().is_empty(),
        "nothing changed, nothing re-parsed"
    );

    // Modify one object of a.yaml: only it is returned.
    std::fs::write(
        &a,
        format!("{}---\n{}", pod("p1", "10.0.0.11"), pod("p2", "10.0.0.2")),
    )
    .unwrap();
    let u = reader.reread([&a]);
    assert_eq!(summary(&u), vec!["+Pod/a/p1"]);
    assert_eq!(ip_of(&u, "p1").as_deref(), Some("10.0.0.11"));

    // A bad edit: p1 rejected (bad IP), p2 removed from the file.
    std::fs::write(&a, pod("p1", "10.0.0.300")).unwrap();
    let u = reader.reread([&a]);
    assert_eq!(
        summary(&u),
        vec!["-Pod/a/p2"],
        "p1's last good version keeps serving"
    );
    let errs = errors_for(&u, &a).expect("a.yaml's errors");
    assert_eq!(
        (
            errs.len(),
            errs[0].document,
            errs[0].line,
            errs[0].name.as_str()
        ),
        (1, 0, 1, "p1")
    );

    // Not even YAML: nothing is deleted, the error is replaced.
    std::fs::write(
        &a,
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p1\n   namespace: [\n",
    )
    .unwrap();
    let u = reader.reread([&a]);
    assert!(u.changes.is_empty(), "{:?}", summary(&u));
    let errs = errors_for(&u, &a).unwrap();
    assert!(
        errs[0].reason.contains("YAML syntax error"),
        "{}",
        errs[0].reason
    );
    assert_eq!(errs[0].name, "p1");
    let served: Vec<String> = {
        let mut v: Vec<String> = reader.objects().map(|o| o.key().to_string()).collect();
        v.sort();
        v
    };
    assert_eq!(served, vec!["Pod/a/p1", "Pod/a/p3"]);

    // Fixed: the new version is returned and the errors are cleared.
    std::fs::write(&a, pod("p1", "10.0.0.12")).unwrap();
    let u = reader.reread([&a]);
    assert_eq!(summary(&u), vec!["+Pod/a/p1"]);
    assert_eq!(errors_for(&u, &a), Some(&vec![]));

    // A new directory, then its removal; a removed file.
    std::fs::create_dir(root.join("new")).unwrap();
    std::fs::write(root.join("new/c.yaml"), pod("p4", "10.0.0.4")).unwrap();
    assert_eq!(
        summary(&reader.reread([root.join("new")])),
        vec!["+Pod/a/p4"]
    );
    std::fs::remove_dir_all(root.join("new")).unwrap();
    assert_eq!(
        summary(&reader.reread([root.join("new")])),
        vec!["-Pod/a/p4"]
    );
    std::fs::remove_file(&b).unwrap();
    let u = reader.reread([&b]);
    assert_eq!(summary(&u), vec!["-Pod/a/p3"]);
    assert_eq!(errors_for(&u, &b), Some(&vec![]));
}

#[test]
fn unreadable_and_non_utf8_files_keep_their_objects() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.yaml");
    std::fs::write(&a, pod("p1", "10.0.0.1")).unwrap();
    let mut reader = ConfigDir::new(dir.path());
    assert_eq!(summary(&reader.rescan()), vec!["+Pod/a/p1"]);
    std::fs::write(&a, [0xffu8, 0xfe, 0x00]).unwrap();
    let u = reader.reread([&a]);
    assert!(u.changes.is_empty());
    assert!(
        errors_for(&u, &a).unwrap()[0]
            .reason
            .contains("not valid UTF-8")
    );
}

#[test]
fn oversized_files_are_not_read_and_keep_their_objects() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.yaml");
    std::fs::write(&a, pod("p1", "10.0.0.1")).unwrap();
    let mut reader = ConfigDir::new(dir.path());
    assert_eq!(summary(&reader.rescan()), vec!["+Pod/a/p1"]);
    // A sparse 17 MiB file: rejected from its size, without reading it.
    let f = std::fs::File::options().write(true).open(&a).unwrap();
    f.set_len(crate::limits::MAX_FILE_BYTES + 1).unwrap();
    let started = std::time::Instant::now();
    let u = reader.reread([&a]);
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
    assert!(u.changes.is_empty(), "{:?}", summary(&u));
    let reason = &errors_for(&u, &a).unwrap()[0].reason;
    assert!(reason.contains("(the file-size limit)"), "{reason}");
    assert!(reason.contains("16777216 bytes"), "{reason}");
    // Fixed: read again.
    std::fs::write(&a, pod("p1", "10.0.0.2")).unwrap();
    assert_eq!(summary(&reader.reread([&a])), vec!["+Pod/a/p1"]);
}

/// A new file redefining a served object does not replace it: the first
/// definition keeps serving, the duplicate is an error naming both files,
/// and it takes over when the first file drops the object.
#[test]
fn first_serving_definition_wins_over_later_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let (pods, dup) = (dir.path().join("pods.yaml"), dir.path().join("dup.yaml"));
    std::fs::write(&pods, pod("p1", "10.0.0.1")).unwrap();
    let mut reader = ConfigDir::new(dir.path());
    assert_eq!(summary(&reader.rescan()), vec!["+Pod/a/p1"]);

    // dup.yaml sorts first, but pods.yaml was serving.
    std::fs::write(&dup, format!("# copy\n{}", pod("p1", "10.0.0.9"))).unwrap();
    let u = reader.reread([&dup]);
    assert!(u.changes.is_empty(), "{:?}", summary(&u));
    let errs = errors_for(&u, &dup).expect("dup.yaml's errors");
    assert_eq!(errs.len(), 1, "{errs:#?}");
    let e = &errs[0];
    assert_eq!(
        (e.file.as_str(), e.line, e.kind.as_str(), e.name.as_str()),
        (dup.display().to_string().as_str(), 2, "Pod", "p1")
    );
    assert!(
        e.reason.contains(&pods.display().to_string()),
        "{}",
        e.reason
    );
    assert!(e.reason.contains("keeps serving"), "{}", e.reason);
    assert_eq!(reader.errors().count(), 1);

    // Re-reading pods.yaml unchanged or with other edits keeps its place.
    std::fs::write(
        &pods,
        format!("{}---\n{}", pod("p1", "10.0.0.1"), pod("p2", "10.0.0.2")),
    )
    .unwrap();
    assert_eq!(summary(&reader.reread([&pods])), vec!["+Pod/a/p2"]);

    // pods.yaml drops p1: dup.yaml's definition takes over, its error clears.
    std::fs::write(&pods, pod("p2", "10.0.0.2")).unwrap();
    let u = reader.reread([&pods]);
    assert_eq!(summary(&u), vec!["+Pod/a/p1"]);
    assert_eq!(ip_of(&u, "p1").as_deref(), Some("10.0.0.9"));
    assert_eq!(errors_for(&u, &dup), Some(&vec![]), "{:?}", u.errors);
    assert_eq!(reader.errors().count(), 0);

    // On a first load the path order decides.
    std::fs::write(&pods, pod("p1", "10.0.0.1")).unwrap();
    let mut fresh = ConfigDir::new(dir.path());
    let u = fresh.rescan();
    assert_eq!(
        ip_of(&u, "p1").as_deref(),
        Some("10.0.0.9"),
        "dup.yaml sorts first"
    );
    assert_eq!(errors_for(&u, &pods).map(Vec::len), Some(1));
}
