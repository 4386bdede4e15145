//! `cargo run --release` (bench/peers.py runs it): the peer workload of bench/peers.py into
//! kvledger's `Group` and Dynamo's `RadixTree`, natively, in one process; prints its figures
//! as one JSON object.

use std::time::Instant;

use _core::group::{Content, Group, StoreRun};
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent,
    KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::radix_tree::RadixTree;

const CHAINS: u64 = 8000;
const LENGTH: usize = 128;
const INSTANCES: u64 = 64;
const BLOCK: usize = 16;
const LOOKUPS: usize = 2000;
const APPLY_ROUNDS: usize = 3;

/// (worker, blocks held from the chain's start), as bench/peers.py holds them.
fn holders(c: u64) -> [(u64, usize); 3] {
    let one = |k: u64| {
        let instance = (c * 7 + k * 13) % INSTANCES;
        (
            instance * 2 + u64::from(k == 2),
            17 + ((c * 31 + k * 17) % (LENGTH as u64 - 16)) as usize,
        )
    };
    [one(0), one(1), one(2)]
}

fn block_hash(c: u64, i: usize) -> u64 {
    let mut x =
        c.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 32)
}

fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn percentiles(mut t: Vec<f64>) -> (f64, f64) {
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2] * 1e6, t[t.len() * 99 / 100] * 1e6)
}

fn timed<T>(inputs: &[T], mut f: impl FnMut(&T) -> usize) -> (f64, f64, usize) {
    let mut times = Vec::with_capacity(inputs.len());
    let mut found = 0;
    for x in inputs {
        let t = Instant::now();
        found += f(x);
        times.push(t.elapsed().as_secs_f64());
    }
    let (p50, p99) = percentiles(times);
    (p50, p99, found)
}

/// LOOKUPS chains drawn from a xorshift stream at `state`.
fn pick(state: &mut u64) -> Vec<u64> {
    (0..LOOKUPS)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            *state % CHAINS
        })
        .collect()
}

/// The prompts of the chains `picked`: by block hashes, and by token ids.
fn prompts<'a>(keys: &'a [Vec<[u8; 8]>], picked: &[u64]) -> (Vec<Vec<&'a [u8]>>, Vec<Vec<i32>>) {
    let hashes = picked
        .iter()
        .map(|&c| keys[c as usize].iter().map(|k| &k[..]).collect())
        .collect();
    let tokens = picked
        .iter()
        .map(|&c| vec![c as i32; LENGTH * BLOCK])
        .collect();
    (hashes, tokens)
}

/// A full block of BLOCK tokens at position `i` of its chain.
fn full_block<'a>(parent: Option<&'a [u8]>, i: usize, tokens: &'a [i32]) -> Content<'a> {
    Content {
        parent,
        start: Some((i * BLOCK) as i64),
        tokens,
        block_size: BLOCK as i32,
        partial: false,
        lora: None,
        plain: true,
        salt: None,
    }
}

/// The store's path: a block's content the first time it is met (as the router's store
/// merges rows), then each holder's residency.
fn build_kvledger(keys: &[Vec<[u8; 8]>]) -> (Group, usize) {
    let mut group = Group::new();
    let mut blocks = 0usize;
    for c in 0..CHAINS {
        let tokens = vec![c as i32; BLOCK];
        for (worker, n) in holders(c) {
            let mut parent: Option<&[u8]> = None;
            for (i, key) in keys[c as usize][..n].iter().enumerate() {
                let key = &key[..];
                if !group.has_content(key) {
                    group.add_row(key, &full_block(parent, i, &tokens));
                }
                group.hold(key, worker as usize, 1);
                parent = Some(key);
            }
            blocks += n;
        }
    }
    (group, blocks)
}

/// Each chain's block hashes and token ids, as store events carry them.
fn chain_events(keys: &[Vec<[u8; 8]>]) -> Vec<(Vec<&[u8]>, Vec<i32>)> {
    let (hashes, tokens) = prompts(keys, &(0..CHAINS).collect::<Vec<u64>>());
    hashes.into_iter().zip(tokens).collect()
}

/// The router's path (its lane): each holder's chain as one store event, `store_run`.
fn build_by_events(chains: &[(Vec<&[u8]>, Vec<i32>)]) -> (Group, usize) {
    let mut group = Group::new();
    let mut blocks = 0usize;
    for (c, (hashes, tokens)) in chains.iter().enumerate() {
        for (worker, n) in holders(c as u64) {
            let run = StoreRun {
                hashes: &hashes[..n],
                parent: None,
                start: Some(0),
                tokens: &tokens[..n * BLOCK],
                block_size: BLOCK as i32,
                partial: false,
                lora: None,
            };
            group
                .store_run(&run, worker as usize, false)
                .expect("a store the lane takes");
            blocks += n;
        }
    }
    (group, blocks)
}

/// `blocks` distinct blocks in chains of LENGTH, each chain held by one holder, with token
/// ids from a 128,256-id vocabulary (a xorshift stream): a large index's memory.
fn build_large(blocks: usize) -> Group {
    let mut group = Group::new();
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut tokens = [0i32; BLOCK];
    for b in 0..blocks {
        let (c, i) = (b / LENGTH, b % LENGTH);
        for t in tokens.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *t = (state % 128_256) as i32;
        }
        let key = block_hash(c as u64, i).to_be_bytes();
        let parent = (i > 0).then(|| block_hash(c as u64, i - 1).to_be_bytes());
        group.add_row(
            &key,
            &full_block(parent.as_ref().map(|p| &p[..]), i, &tokens),
        );
        group.hold(&key, c % INSTANCES as usize, 1);
    }
    group
}

fn dynamo_event(local: &[u64], c: u64, worker: u64, n: usize, id: u64) -> RouterEvent {
    let blocks = (0..n)
        .map(|i| KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(block_hash(c, i)),
            tokens_hash: LocalBlockHash(local[c as usize]),
            mm_extra_info: None,
        })
        .collect();
    let data = KvCacheStoreData {
        parent_hash: None,
        start_position: None,
        blocks,
    };
    let event = KvCacheEvent {
        event_id: id,
        data: KvCacheEventData::Stored(data),
        dp_rank: 0,
    };
    RouterEvent::new(worker, event)
}

fn dynamo_events(local: &[u64]) -> Vec<RouterEvent> {
    let mut events = Vec::new();
    for c in 0..CHAINS {
        for (worker, n) in holders(c) {
            events.push(dynamo_event(local, c, worker, n, events.len() as u64));
        }
    }
    events
}

fn main() {
    let keys: Vec<Vec<[u8; 8]>> = (0..CHAINS)
        .map(|c| {
            (0..LENGTH)
                .map(|i| block_hash(c, i).to_be_bytes())
                .collect()
        })
        .collect();
    let options = BlockHashOptions {
        block_mm_infos: None,
        lora_name: None,
        cache_namespace: None,
        is_eagle: None,
    };
    let local: Vec<u64> = (0..CHAINS)
        .map(|c| compute_block_hash_for_seq(&[c as u32; BLOCK], BLOCK as u32, options)[0].0)
        .collect();
    match std::env::args().nth(1).as_deref() {
        Some("memory-kvledger") => {
            let before = rss();
            let (group, _) = build_kvledger(&keys);
            println!("{}", rss() - before);
            drop(group);
            return;
        }
        Some("profile-events") => {
            // Applying by events alone, for a profiler.
            let mut blocks = 0;
            for _ in 0..5 {
                blocks += build_by_events(&chain_events(&keys)).1;
            }
            println!("{blocks}");
            return;
        }
        Some("profile-apply") => {
            // Applying alone, for a profiler: `perf record ... profile-apply`.
            let mut blocks = 0;
            for _ in 0..5 {
                blocks += build_kvledger(&keys).1;
            }
            println!("{blocks}");
            return;
        }
        Some("profile-tokens") => {
            // Token lookups alone, for a profiler: `perf record ... profile-tokens`.
            let (group, _) = build_kvledger(&keys);
            let mut found = 0;
            for round in 0..200u64 {
                let c = (round * 7919) % CHAINS;
                let tokens = vec![c as i32; LENGTH * BLOCK];
                for _ in 0..2000 {
                    found += group.match_tokens(&tokens, BLOCK, BLOCK, None, None).len();
                }
            }
            println!("{found}");
            return;
        }
        Some("profile-hashes") => {
            // Hash lookups alone, for a profiler: `perf record ... profile-hashes`.
            let (group, _) = build_kvledger(&keys);
            let mut found = 0;
            for round in 0..200u64 {
                let c = (round * 7919) % CHAINS;
                let hashes: Vec<&[u8]> = keys[c as usize].iter().map(|k| &k[..]).collect();
                for _ in 0..2000 {
                    found += group.runs(&hashes).len();
                }
            }
            println!("{found}");
            return;
        }
        Some("ratio-tokens") => {
            // Token against hash lookups, cold, alternating: each round's p50s and ratio.
            let (group, _) = build_kvledger(&keys);
            let mut state = 7u64;
            for _ in 0..10 {
                let (hashes, tokens) = prompts(&keys, &pick(&mut state));
                let h = timed(&hashes, |h| group.runs(h).len());
                let t = timed(&tokens, |t| {
                    group.match_tokens(t, BLOCK, BLOCK, None, None).len()
                });
                println!("{:.2} {:.2} {:.2}", h.0, t.0, t.0 / h.0);
            }
            return;
        }
        Some("memory-10m") => {
            // Ten million distinct blocks (chains of LENGTH, one holder each, token ids
            // drawn from a 128,256-id vocabulary, as Llama 3 has): the resident bytes.
            let before = rss();
            let group = build_large(10_000_000);
            println!("{}", rss() - before);
            drop(group);
            return;
        }
        Some("memory-dynamo") => {
            let before = rss();
            let mut tree = RadixTree::new();
            for c in 0..CHAINS {
                for (worker, n) in holders(c) {
                    tree.apply_event(dynamo_event(&local, c, worker, n, 0))
                        .expect("a valid event");
                }
            }
            println!("{}", rss() - before);
            drop(tree);
            return;
        }
        _ => {}
    }

    // Apply rates: each index built APPLY_ROUNDS times in turn and each one's best kept
    // (the machine is noisy: one build's page-reclaim pause would otherwise be the figure).
    let chains = chain_events(&keys); // made before the clock, as Dynamo's events are
    let (mut kv_apply, mut kv_events, mut dyn_apply) = (f64::MAX, f64::MAX, f64::MAX);
    let mut built = None;
    for _ in 0..APPLY_ROUNDS {
        let start = Instant::now();
        let (group, blocks) = build_kvledger(&keys);
        kv_apply = kv_apply.min(start.elapsed().as_secs_f64());
        let start = Instant::now();
        let (by_events, _) = build_by_events(&chains);
        kv_events = kv_events.min(start.elapsed().as_secs_f64());
        assert_eq!(
            by_events.blocks(),
            group.blocks(),
            "the same blocks either way"
        );
        drop(by_events);
        let events = dynamo_events(&local);
        let mut tree = RadixTree::new();
        let start = Instant::now();
        for event in events {
            tree.apply_event(event).expect("a valid event");
        }
        dyn_apply = dyn_apply.min(start.elapsed().as_secs_f64());
        built = Some((group, blocks, tree));
    }
    let (group, blocks, tree) = built.expect("one round at least");
    // Resident memory, each index built alone in a process of its own (events made one at a
    // time as they are applied: a batch of them freed as the tree grows would be reused).
    let memory = |side: &str| -> f64 {
        let out = std::process::Command::new(std::env::current_exe().expect("this program"))
            .arg(side)
            .output()
            .expect("the memory pass runs");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<f64>()
            .expect("bytes")
    };
    let (kv_bytes, dyn_bytes) = (memory("memory-kvledger"), memory("memory-dynamo"));
    let large_bytes = memory("memory-10m");

    let picked = pick(&mut 1u64);
    let (hashes, tokens) = prompts(&keys, &picked);
    let locals: Vec<Vec<LocalBlockHash>> = picked
        .iter()
        .map(|&c| vec![LocalBlockHash(local[c as usize]); LENGTH])
        .collect();
    let utokens: Vec<Vec<u32>> = picked
        .iter()
        .map(|&c| vec![c as u32; LENGTH * BLOCK])
        .collect();
    let mut figures = vec![
        ("stored blocks".to_string(), blocks as f64),
        (
            "native: kvledger apply, block events/s".into(),
            blocks as f64 / kv_apply,
        ),
        (
            "native: kvledger apply by events (store_run), block events/s".into(),
            blocks as f64 / kv_events,
        ),
        (
            "native: Dynamo apply, block events/s".into(),
            blocks as f64 / dyn_apply,
        ),
        (
            "native: kvledger bytes per held block".into(),
            kv_bytes / blocks as f64,
        ),
        (
            "native: Dynamo bytes per held block".into(),
            dyn_bytes / blocks as f64,
        ),
        (
            "native: kvledger 10 M blocks, resident GB (target 1.6)".into(),
            large_bytes / 1e9,
        ),
    ];
    for round in 0..2 {
        let kv_h = timed(&hashes, |h| group.runs(h).len());
        let dyn_h = timed(&locals, |l| {
            tree.find_matches(l.clone(), false).scores.len()
        });
        let kv_t = timed(&tokens, |t| {
            group.match_tokens(t, BLOCK, BLOCK, None, None).len()
        });
        let dyn_t = timed(&utokens, |t| {
            tree.find_matches(compute_block_hash_for_seq(t, BLOCK as u32, options), false)
                .scores
                .len()
        });
        assert_eq!(kv_h.2, dyn_h.2, "the same holders found");
        if round == 1 {
            for (name, (p50, p99, _)) in [
                ("kvledger lookup by hashes", kv_h),
                ("Dynamo lookup by hashes", dyn_h),
                ("kvledger lookup by tokens", kv_t),
                ("Dynamo lookup by tokens", dyn_t),
            ] {
                figures.push((format!("native: {name}: p50 us"), p50));
                figures.push((format!("native: {name}: p99 us"), p99));
            }
        }
    }
    // Expiry (a router's bound on memory): a pass with nothing to drop, the periodic cost,
    // then one after every holder of half the chains let go, beside applying those blocks.
    let mut group = group;
    let start = Instant::now();
    let none = group.expire(0);
    let idle = start.elapsed().as_secs_f64();
    let mut let_go = 0usize;
    for c in (0..CHAINS).step_by(2) {
        for (worker, n) in holders(c) {
            for key in &keys[c as usize][..n] {
                group.hold(key, worker as usize, 0);
            }
            let_go += n;
        }
    }
    group.set_clock(1);
    let start = Instant::now();
    let dropped = group.expire(1);
    let drop_s = start.elapsed().as_secs_f64();
    assert!(none == 0 && dropped > 0, "half the chains expire");
    figures.extend([
        (
            "native: kvledger expiry pass with nothing to drop, ms".into(),
            idle * 1e3,
        ),
        (
            "native: kvledger expiry, blocks dropped (half the chains let go)".into(),
            dropped as f64,
        ),
        (
            "native: kvledger expiry, us per block dropped".into(),
            drop_s * 1e6 / dropped as f64,
        ),
        (
            "native: kvledger apply, us per block (the baseline)".into(),
            kv_apply * 1e6 / blocks as f64,
        ),
        ("native: residencies let go".into(), let_go as f64),
    ]);
    let body: Vec<String> = figures.iter().map(|(k, v)| format!("{k:?}: {v}")).collect();
    println!("{{{}}}", body.join(", "));
}
