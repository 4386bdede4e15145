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
    let mut by_tokens = g.match_tokens(&[1, 2, 3, 4, 5], 2, 2, None);
    by_tokens.sort();
    assert_eq!(by_tokens, vec![(3, 2, 4), (70, 1, 2)]);
    assert!(g
        .match_tokens(&[1, 2, 3, 9], 2, 2, None)
        .iter()
        .all(|r| r.1 == 1));
    assert!(g.match_tokens(&[1, 2], 2, 2, Some("adapter")).is_empty());
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
    assert_eq!(g.match_tokens(&[1, 2, 3, 4], 2, 2, None), vec![(0, 2, 4)]);
    g.add_row(b"a", &content(Some(b"b"), 0, &[1, 2])); // a's parent is now b: a cycle
    assert!(g.match_tokens(&[1, 2, 3, 4], 2, 2, None).is_empty());
    g.add_row(b"c", &content(Some(b"c"), 0, &[1, 2])); // its own parent
    assert!(g.match_tokens(&[1, 2], 2, 2, None).is_empty());
    g.add_row(b"a", &content(None, 0, &[1, 2])); // the cycle broken again
    assert_eq!(g.match_tokens(&[1, 2, 3, 4], 2, 2, None), vec![(0, 2, 4)]);
}

#[test]
fn metadata_changes_move_a_row_in_the_content_index() {
    let mut g = Group::new();
    g.add_row(b"a", &content(None, 0, &[1, 2]));
    g.hold(b"a", 0, 1);
    assert_eq!(g.match_tokens(&[1, 2], 2, 2, None).len(), 1);
    g.set_meta(b"a", Some("lora"), true);
    assert!(g.match_tokens(&[1, 2], 2, 2, None).is_empty());
    assert_eq!(g.match_tokens(&[1, 2], 2, 2, Some("lora")).len(), 1);
    g.set_meta(b"a", Some("lora"), false); // extra keys: no token walk uses it
    assert!(g.match_tokens(&[1, 2], 2, 2, Some("lora")).is_empty());
}
