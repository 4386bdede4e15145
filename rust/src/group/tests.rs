//! The group's own tests (the Python tests hold it to the pure twin).

use super::*;

fn content<'a>(parent: Option<&'a [u8]>, start: i64, tokens: &'a [i32]) -> Content<'a> {
    Content {
        parent,
        start: Some(start),
        tokens,
        block_size: tokens.len() as i32,
        partial: false,
        lora: None,
        plain: true,
        salt: None,
    }
}

#[test]
fn a_chain_is_found_by_its_tokens_and_by_its_hashes() {
    let mut g = Group::new();
    let (a, b) = (b"a".as_slice(), b"b".as_slice());
    g.add_row(a, &content(None, 0, &[1, 2]));
    g.add_row(b, &content(Some(a), 2, &[3, 4]));
    g.hold(a, 3, 1);
    g.hold(b, 3, 2);
    g.hold(a, 70, 1);
    assert_eq!(g.refcount(b, 3), 2);
    let mut by_hash = g.runs(&[a, b]);
    by_hash.sort();
    assert_eq!(by_hash, vec![(3, 2, 4), (70, 1, 2)]);
    let mut by_tokens = g.match_tokens(&[1, 2, 3, 4, 5], 2, 2, None, None);
    by_tokens.sort();
    assert_eq!(by_tokens, vec![(3, 2, 4), (70, 1, 2)]);
    assert!(g
        .match_tokens(&[1, 2, 3, 9], 2, 2, None, None)
        .iter()
        .all(|r| r.1 == 1));
    assert!(g
        .match_tokens(&[1, 2], 2, 2, Some("adapter"), None)
        .is_empty());
}

#[test]
fn rows_without_content_go_when_nothing_holds_or_names_them() {
    let mut g = Group::new();
    g.hold(b"x", 1, 1);
    assert_eq!(g.live, 1);
    g.hold(b"x", 1, 0);
    assert_eq!((g.live, g.free.len()), (0, 1));
    g.add_row(b"child", &content(Some(b"parent"), 0, &[1]));
    assert_eq!((g.live, g.blocks()), (2, 1)); // the parent is named: it stays
    g.add_row(b"child", &content(None, 0, &[1]));
    assert_eq!(g.live, 1); // no longer named
    assert!(g.stored(b"parent").is_none() && g.stored(b"child").is_some());
}

#[test]
fn a_cycle_of_parents_is_reached_by_no_walk_and_ends() {
    let mut g = Group::new();
    g.add_row(b"a", &content(None, 0, &[1, 2]));
    g.add_row(b"b", &content(Some(b"a"), 2, &[3, 4]));
    g.hold(b"a", 0, 1);
    g.hold(b"b", 0, 1);
    assert_eq!(
        g.match_tokens(&[1, 2, 3, 4], 2, 2, None, None),
        vec![(0, 2, 4)]
    );
    g.add_row(b"a", &content(Some(b"b"), 0, &[1, 2])); // a's parent is now b: a cycle
    assert!(g.match_tokens(&[1, 2, 3, 4], 2, 2, None, None).is_empty());
    g.add_row(b"c", &content(Some(b"c"), 0, &[1, 2])); // its own parent
    assert!(g.match_tokens(&[1, 2], 2, 2, None, None).is_empty());
    g.add_row(b"a", &content(None, 0, &[1, 2])); // the cycle broken again
    assert_eq!(
        g.match_tokens(&[1, 2, 3, 4], 2, 2, None, None),
        vec![(0, 2, 4)]
    );
}

#[test]
fn metadata_changes_move_a_row_in_the_content_index() {
    let mut g = Group::new();
    g.add_row(b"a", &content(None, 0, &[1, 2]));
    g.hold(b"a", 0, 1);
    assert_eq!(g.match_tokens(&[1, 2], 2, 2, None, None).len(), 1);
    g.set_meta(b"a", Some("lora"), true, None);
    assert!(g.match_tokens(&[1, 2], 2, 2, None, None).is_empty());
    assert_eq!(g.match_tokens(&[1, 2], 2, 2, Some("lora"), None).len(), 1);
    g.set_meta(b"a", Some("lora"), false, None); // extra keys: no token walk uses it
    assert!(g.match_tokens(&[1, 2], 2, 2, Some("lora"), None).is_empty());
}

#[test]
fn a_salted_prompt_is_walked_from_the_first_block_of_its_salt() {
    let mut g = Group::new();
    let hid = 0;
    g.add_row(
        b"s0",
        &Content {
            salt: Some("salt-1"),
            ..content(None, 0, &[1, 2])
        },
    );
    g.add_row(b"s1", &content(Some(b"s0"), 2, &[3, 4]));
    g.add_row(b"p0", &content(None, 0, &[1, 2])); // the same tokens, unsalted
    for key in [&b"s0"[..], b"s1", b"p0"] {
        g.hold(key, hid, 1);
    }
    let salted = g.match_tokens(&[1, 2, 3, 4], 2, 2, None, Some("salt-1"));
    assert_eq!(salted, vec![(hid, 2, 4)]);
    assert_eq!(
        g.match_tokens(&[1, 2, 3, 4], 2, 2, None, None),
        vec![(hid, 1, 2)]
    );
    assert!(g
        .match_tokens(&[1, 2], 2, 2, None, Some("salt-2"))
        .is_empty());
    // A salt is an extra key to Dynamo: no local hash for the salted block.
    g.enable_dynamo();
    assert!(g.dynamo_local(b"s0").is_none() && g.dynamo_local(b"p0").is_some());
}
