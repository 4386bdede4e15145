//! Dynamo's `POST /query` body read natively: the prompt's token ids go from the JSON text
//! to their packed u32 bytes (what Dynamo's block hash reads) without a Python int each.
//!
//! This is a fast path only: it takes a subset of what the service's msgspec reading
//! (serving/lookup/dynamo.py `parse_query`) takes, with the same values, and declines
//! everything else (`None`), which that reading then answers or refuses with its status.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

fn default_group() -> String {
    "default".to_owned()
}

/// The fields of a /query body (unknown fields are ignored, as msgspec ignores them).
#[derive(Deserialize)]
pub struct TokenQuery {
    pub token_ids: Vec<u32>,
    pub model_name: String,
    // A string when given: null is a type error there, as it is to msgspec.
    #[serde(default = "default_group")]
    pub routing_group: String,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// The body as a token query, or None where the fast path declines it: not an object (a
/// struct would also read from an array), not exactly these types, a duplicate field, a
/// cache salt (refused by the full reading, with its own words).
pub fn read(raw: &[u8]) -> Option<TokenQuery> {
    let first = raw.iter().find(|b| !b.is_ascii_whitespace())?;
    if *first != b'{' {
        return None;
    }
    let q: TokenQuery = serde_json::from_slice(raw).ok()?;
    if q.cache_salt.is_some() {
        return None;
    }
    Some(q)
}

/// Dynamo's local hash of each full block of packed u32 LE token ids (`local_hash` of
/// the same ids).
pub fn packed_hashes(packed: &[u8], block_size: usize, seed: u64) -> Vec<u64> {
    // No block of 0 tokens, nor of more bytes than an address space holds (a caller's
    // size times 4 overflowing would otherwise wrap to a wrong count, or panic).
    let Some(bytes) = block_size.checked_mul(4).filter(|&b| b > 0) else {
        return Vec::new();
    };
    packed
        .chunks_exact(bytes)
        .map(|block| xxh3_64_with_seed(block, seed))
        .collect()
}

/// dynamo_token_query(raw) -> (model_name, routing_group, lora_name, packed token ids) or
/// None: see the module's words.
#[pyfunction]
pub fn dynamo_token_query<'py>(
    py: Python<'py>,
    raw: &[u8],
) -> Option<(String, String, Option<String>, Bound<'py, PyBytes>)> {
    let q = read(raw)?;
    let mut packed = Vec::with_capacity(q.token_ids.len() * 4);
    for t in &q.token_ids {
        packed.extend_from_slice(&t.to_le_bytes());
    }
    Some((
        q.model_name,
        q.routing_group,
        q.lora_name,
        PyBytes::new(py, &packed),
    ))
}

/// dynamo_packed_hashes(packed, block_size, seed) -> [int]: as `dynamo_block_hashes` of
/// the ids `dynamo_token_query` packed.
#[pyfunction]
pub fn dynamo_packed_hashes(packed: &[u8], block_size: i64, seed: u64) -> Vec<u64> {
    usize::try_from(block_size).map_or_else(|_| Vec::new(), |bs| packed_hashes(packed, bs, seed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::{local_hash, seed_for};

    #[test]
    fn reads_a_query_and_declines_the_rest() {
        let q = read(br#" {"token_ids": [1, 4294967295], "model_name": "m", "x": [1]} "#).unwrap();
        assert_eq!(q.token_ids, vec![1, u32::MAX]);
        assert_eq!(
            (q.model_name.as_str(), q.routing_group.as_str()),
            ("m", "default")
        );
        assert_eq!(q.lora_name, None);
        for declined in [
            &br#"[[1], "m"]"#[..],
            br#"{"token_ids": [1.0], "model_name": "m"}"#,
            br#"{"token_ids": [4294967296], "model_name": "m"}"#,
            br#"{"token_ids": [-1], "model_name": "m"}"#,
            br#"{"token_ids": [1], "model_name": "m", "routing_group": null}"#,
            br#"{"token_ids": [1], "model_name": "m", "cache_salt": "s"}"#,
            br#"{"token_ids": [1], "model_name": "m", "model_name": "n"}"#,
            br#"{"token_ids": [1], "model_name": "m"} x"#,
            b"",
        ] {
            assert!(
                read(declined).is_none(),
                "{}",
                String::from_utf8_lossy(declined)
            );
        }
    }

    #[test]
    fn packed_hashes_are_local_hashes() {
        let ids: Vec<i32> = (0..10).chain([-1, i32::MIN]).collect();
        let packed: Vec<u8> = ids.iter().flat_map(|t| (*t as u32).to_le_bytes()).collect();
        let seed = seed_for(Some("adapter"));
        let want: Vec<u64> = ids.chunks_exact(4).map(|b| local_hash(b, seed)).collect();
        assert_eq!(packed_hashes(&packed, 4, seed), want);
        assert!(packed_hashes(&packed, 0, seed).is_empty());
        for huge in [1 << 62, (1 << 62) + 1, usize::MAX] {
            assert!(packed_hashes(&packed, huge, seed).is_empty());
        }
    }
}
