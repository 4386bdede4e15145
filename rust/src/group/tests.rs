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
fn a_holders_path_names_its_own_hashes_down_the_prompt() {
    let mut g = Group::new();
    // Two engines hashing the same content apart; a third block on the first alone.
    let (a1, b1, c1) = (b"a1".as_slice(), b"b1".as_slice(), b"c1".as_slice());
    let (a2, b2) = (b"a2".as_slice(), b"b2".as_slice());
    g.add_row(a1, &content(None, 0, &[1, 2]));
    g.add_row(b1, &content(Some(a1), 2, &[3, 4]));
    g.add_row(c1, &content(Some(b1), 4, &[5, 6]));
    g.add_row(a2, &content(None, 0, &[1, 2]));
    g.add_row(b2, &content(Some(a2), 2, &[3, 4]));
    for key in [a1, b1, c1] {
        g.hold(key, 1, 1);
    }
    g.hold(a2, 2, 1);
    g.hold(b2, 2, 1);
    g.hold(a1, 3, 1); // holds the first block only
    let prompt = [1, 2, 3, 4, 5, 6, 7];
    assert_eq!(g.held_path(&prompt, 2, None, None, 1), vec![a1, b1, c1]);
    assert_eq!(g.held_path(&prompt, 2, None, None, 2), vec![a2, b2]);
    assert_eq!(g.held_path(&prompt, 2, None, None, 3), vec![a1]);
    assert!(g.held_path(&prompt, 2, None, None, 4).is_empty());
    assert!(g.held_path(&[9, 9, 3, 4], 2, None, None, 1).is_empty()); // from the root
    assert!(g.held_path(&prompt, 2, Some("adapter"), None, 1).is_empty());
    assert!(g.held_path(&prompt, 0, None, None, 1).is_empty());
    // Holding both hashings of the first block, and the second under the other only.
    g.hold(a2, 5, 1);
    g.hold(a1, 5, 1);
    g.hold(b2, 5, 1);
    assert_eq!(g.held_path(&prompt, 2, None, None, 5), vec![a2, b2]);
    // As far as the walk by tokens says it holds.
    let runs = g.match_tokens(&prompt, 2, 2, None, None);
    for hid in 1..6 {
        let held = runs.iter().find(|r| r.0 == hid).map_or(0, |r| r.1);
        assert_eq!(g.held_path(&prompt, 2, None, None, hid).len(), held);
    }
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

#[test]
fn unheld_chains_expire_from_their_leaves_and_their_tokens_are_given_back() {
    let mut g = Group::new();
    // 40 chains of 100 blocks of 32 tokens (128,000 tokens, ids past 2**24: 4 bytes
    // each), keys of 32 bytes (the side table); stored at time 10, held by holder 1.
    const BIG: u32 = 1 << 24;
    let key = |c: u32, i: u32| {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&c.to_le_bytes());
        k[4..8].copy_from_slice(&i.to_le_bytes());
        k
    };
    g.set_clock(10);
    for c in 0..40u32 {
        for i in 0..100u32 {
            let tokens: Vec<i32> = (0..32)
                .map(|t| (BIG + c * 1000 + i * 32 + t) as i32)
                .collect();
            let parent = (i > 0).then(|| key(c, i - 1));
            let start = i64::from(i) * 32;
            g.add_row(
                &key(c, i),
                &content(parent.as_ref().map(|p| &p[..]), start, &tokens),
            );
            g.hold(&key(c, i), 1, 1);
        }
    }
    let walk = |g: &Group, c: u32| {
        let tokens: Vec<i32> = (0..3200).map(|t| (BIG + c * 1000 + t) as i32).collect();
        g.match_tokens(&tokens, 32, 32, None, None)
    };
    assert_eq!(walk(&g, 7), vec![(1, 100, 3200)]);
    // Chain 0..20 let go at 20; chain 20..40 keeps its first half held.
    g.set_clock(20);
    for c in 0..40u32 {
        for i in (if c < 20 { 0 } else { 50 })..100 {
            g.hold(&key(c, i), 1, 0);
        }
    }
    assert_eq!(g.expire(20), 0, "nothing is older than the cutoff");
    assert_eq!(
        g.expire(21),
        20 * 100 + 20 * 50,
        "whole chains, and the unheld halves"
    );
    assert_eq!(g.blocks(), 20 * 50);
    assert!(walk(&g, 7).is_empty() && g.find(&key(7, 0)).is_none());
    assert_eq!(walk(&g, 27), vec![(1, 50, 1600)]);
    assert!(
        g.tokens.len_words() <= 20 * 50 * 32,
        "the arena was compacted"
    );
    assert_eq!(g.longs.len() - g.free_longs.len(), 20 * 50);
    // What is stored again is found again, its key reusing a freed row.
    g.set_clock(30);
    let tokens: Vec<i32> = (0..32).map(|t| (BIG + 7000 + t) as i32).collect();
    g.add_row(&key(7, 0), &content(None, 0, &tokens));
    g.hold(&key(7, 0), 2, 1);
    assert_eq!(walk(&g, 7), vec![(2, 1, 32)]);
    assert_eq!(g.rows.len(), 40 * 100);
}

#[test]
fn expiry_a_slice_at_a_time_drops_what_one_pass_drops() {
    let build = || {
        let mut g = Group::new();
        g.set_clock(5);
        for c in 0..50u8 {
            let mut parent: Option<[u8; 8]> = None;
            for i in 0..20u8 {
                let key = [c, i, 1, 1, 1, 1, 1, 1];
                g.add_row(
                    &key,
                    &content(
                        parent.as_ref().map(|p| &p[..]),
                        0,
                        &[i32::from(c), i32::from(i)],
                    ),
                );
                g.hold(&key, usize::from(c % 3), 1);
                parent = Some(key);
            }
        }
        g.set_clock(9);
        for c in (0..50u8).filter(|c| c % 2 == 0) {
            for i in (u8::from(c % 4 == 0) * 10)..20 {
                g.hold(&[c, i, 1, 1, 1, 1, 1, 1], usize::from(c % 3), 0);
            }
        }
        g
    };
    let (mut whole, mut sliced) = (build(), build());
    let all = whole.expire(10);
    let (mut dropped, mut passes) = (0, 0);
    loop {
        let (n, done) = sliced.expire_some(10, 7);
        dropped += n;
        passes += 1;
        if done {
            break;
        }
    }
    assert_eq!((dropped, all), (25 * 20 - 13 * 10, 25 * 20 - 13 * 10));
    assert_eq!(passes, 1000usize.div_ceil(7));
    assert_eq!(sliced.stored_keys(), whole.stored_keys());
    assert_eq!(sliced.expire_some(10, 5000), (0, true));
}

#[test]
fn an_expired_block_leaves_dynamos_table_and_comes_back_when_stored_again() {
    let mut g = Group::new();
    g.enable_dynamo();
    let (a, b) = (b"aaaaaaaa".as_slice(), b"bbbbbbbb".as_slice());
    let locals = [
        local_hash(&[1, 2], seed_for(None)),
        local_hash(&[3, 4], seed_for(None)),
    ];
    let store = |g: &mut Group| {
        g.add_row(a, &content(None, 0, &[1, 2]));
        g.add_row(b, &content(Some(a), 2, &[3, 4]));
        g.hold(a, 0, 1);
        g.hold(b, 0, 1);
    };
    g.set_clock(1);
    store(&mut g);
    assert_eq!(g.dynamo_levels(&locals, 2), vec![(0, vec![0b11])]);
    g.hold(b, 0, 0);
    g.set_clock(5);
    g.hold(a, 0, 0);
    assert_eq!(
        g.expire(2),
        1,
        "b, let go at 1; a was let go at 5 and names b"
    );
    assert!(g.dynamo_local(b).is_none() && g.dynamo_local(a).is_some());
    assert_eq!(g.expire(6), 1);
    assert!(g.dynamo_levels(&locals, 2).is_empty() && g.blocks() == 0);
    g.set_clock(7);
    store(&mut g);
    assert_eq!(g.dynamo_levels(&locals, 2), vec![(0, vec![0b11])]);
}
