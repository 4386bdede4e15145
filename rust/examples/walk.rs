//! A prompt walk over a million-block mask table, natively: `cargo run --release --example walk`.
use std::time::Instant;

use _core::masks::Masks;

fn main() {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let keys: Vec<[u8; 8]> = (0..1_000_000).map(|_| next().to_le_bytes()).collect();
    let mut t = Masks::new();
    let start = Instant::now();
    for (i, k) in keys.iter().enumerate() {
        t.set_bit(k, i % 64);
    }
    let built = start.elapsed().as_secs_f64();
    let prompts: Vec<Vec<&[u8]>> = (0..2000)
        .map(|_| {
            (0..128)
                .map(|_| &keys[next() as usize % keys.len()][..])
                .collect()
        })
        .collect();
    let start = Instant::now();
    let mut found = 0;
    for p in &prompts {
        found += t.runs(p).len();
    }
    let walk = start.elapsed().as_secs_f64() / prompts.len() as f64 * 1e6;
    println!(
        "set_bit {:.2} M/s, runs(128) {walk:.1} us ({found} runs)",
        1.0 / built
    );
}
