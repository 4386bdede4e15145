//! Dynamo's `POST /query` answer written natively: the walk's runs per slot (an instance),
//! left out where the instance is not live, summed up per Dynamo worker and written as the
//! answer's JSON, in one call (serving/lookup/dynamo.py builds the same answer from
//! `PureDynamoSlots` in Python: serving/router/dynamo_pure.py).

use std::collections::HashMap;
use std::io::Write;

use foldhash::fast::RandomState;
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;

/// What an answer needs beside the walk, kept by the service as the index changes: each
/// holder's `slot * 3 + tier` (negative: a tier Dynamo has not), and each slot's Dynamo
/// worker id, data-parallel rank and when its source was last seen.
#[pyclass(module = "kvledger._core", name = "DynamoSlots")]
#[derive(Default)]
pub struct DynamoSlots {
    pub holders: Vec<i64>,
    workers: Vec<(u64, u32)>,
    // microseconds since the epoch; None: closed or unknown (never live)
    seen: Vec<Option<i64>>,
}

#[pymethods]
impl DynamoSlots {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// add_holder(slot_tier): the next holder's `slot * 3 + tier` (negative: none).
    fn add_holder(&mut self, slot_tier: i64) {
        self.holders.push(slot_tier);
    }

    /// set_slot(slot, worker, rank, seen): a slot's worker and rank, and its source's last
    /// sight (µs since the epoch; None: not live whatever the time); `slot` at most the
    /// number of slots (that one is added).
    fn set_slot(&mut self, slot: usize, worker: u64, rank: u32, seen: Option<i64>) -> PyResult<()> {
        if slot > self.workers.len() {
            return Err(PyIndexError::new_err("slots are added in order"));
        }
        if slot == self.workers.len() {
            self.workers.push((worker, rank));
            self.seen.push(seen);
        } else {
            self.workers[slot] = (worker, rank);
            self.seen[slot] = seen;
        }
        Ok(())
    }

    /// set_seen(slot, seen): a slot's source's last sight (see set_slot).
    fn set_seen(&mut self, slot: usize, seen: Option<i64>) -> PyResult<()> {
        match self.seen.get_mut(slot) {
            Some(s) => {
                *s = seen;
                Ok(())
            }
            None => Err(PyIndexError::new_err("no such slot")),
        }
    }

    /// (holders, slots)
    fn sizes(&self) -> (usize, usize) {
        (self.holders.len(), self.workers.len())
    }
}

#[derive(Default)]
struct Instance {
    worker: u64,
    gpu: u64,
    cpu: u64,
    disk: u64,
    dp: Vec<(u32, u64)>,
}

/// Raise `key`'s value to `value` in an insertion-ordered map of few keys (a JSON
/// object's): two sources that are one worker's one rank (`a` and `a-dp0`) score the
/// better of the two.
fn put(map: &mut Vec<(u32, u64)>, key: u32, value: u64) {
    match map.iter_mut().find(|(k, _)| *k == key) {
        Some(entry) => entry.1 = entry.1.max(value),
        None => map.push((key, value)),
    }
}

/// The /query answer of `runs` (slot, blocks on GPU, through CPU, through storage: as
/// `Group::dynamo_runs` gives them), for blocks of `block_size` tokens, scoring the slots
/// whose source was seen at or after `cut`: `{"scores": {worker: {rank: tokens}},
/// "frequencies": [], "instances": {worker: {"longest_matched", "gpu", "dp", "cpu",
/// "disk"}}}`, workers in the order their first slot comes, a worker's figures the best of
/// its ranks'.
pub fn answer(
    runs: &[(u32, u32, u32, u32)],
    slots: &DynamoSlots,
    block_size: u64,
    cut: i64,
) -> Vec<u8> {
    let mut scores: Vec<(u64, Vec<(u32, u64)>)> = Vec::new();
    let mut instances: Vec<Instance> = Vec::new();
    let mut score_at: HashMap<u64, usize, RandomState> = HashMap::default();
    let mut instance_at: HashMap<u64, usize, RandomState> = HashMap::default();
    for &(slot, gpu, cpu, disk) in runs {
        let slot = slot as usize;
        let live = matches!(slots.seen.get(slot), Some(Some(seen)) if *seen >= cut);
        if !live {
            continue;
        }
        let (worker, rank) = slots.workers[slot];
        let (gt, ct, dt) = (
            u64::from(gpu) * block_size,
            u64::from(cpu) * block_size,
            u64::from(disk) * block_size,
        );
        if gt > 0 {
            let at = *score_at.entry(worker).or_insert_with(|| {
                scores.push((worker, Vec::new()));
                scores.len() - 1
            });
            put(&mut scores[at].1, rank, gt);
        }
        match instance_at.get(&worker) {
            None => {
                instance_at.insert(worker, instances.len());
                instances.push(Instance {
                    worker,
                    gpu: gt,
                    cpu: ct,
                    disk: dt,
                    dp: vec![(rank, gt)],
                });
            }
            Some(&at) => {
                let s = &mut instances[at];
                put(&mut s.dp, rank, gt);
                s.gpu = s.gpu.max(gt);
                s.cpu = s.cpu.max(ct);
                s.disk = s.disk.max(dt);
            }
        }
    }
    write_answer(&scores, &instances)
}

fn write_ranks(out: &mut Vec<u8>, ranks: &[(u32, u64)]) {
    out.push(b'{');
    for (i, (rank, tokens)) in ranks.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let _ = write!(out, "\"{rank}\":{tokens}");
    }
    out.push(b'}');
}

fn write_answer(scores: &[(u64, Vec<(u32, u64)>)], instances: &[Instance]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 48 * scores.len() + 96 * instances.len());
    out.extend_from_slice(b"{\"scores\":{");
    for (i, (worker, ranks)) in scores.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let _ = write!(out, "\"{worker}\":");
        write_ranks(&mut out, ranks);
    }
    out.extend_from_slice(b"},\"frequencies\":[],\"instances\":{");
    for (i, s) in instances.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let _ = write!(
            out,
            "\"{}\":{{\"longest_matched\":{},\"gpu\":{},\"dp\":",
            s.worker, s.disk, s.gpu
        );
        write_ranks(&mut out, &s.dp);
        let _ = write!(out, ",\"cpu\":{},\"disk\":{}}}", s.cpu, s.disk);
    }
    out.extend_from_slice(b"}}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(workers: &[(u64, u32, Option<i64>)]) -> DynamoSlots {
        let mut s = DynamoSlots::new();
        for (i, &(w, r, seen)) in workers.iter().enumerate() {
            s.set_slot(i, w, r, seen).unwrap();
        }
        s
    }

    #[test]
    fn answers_sum_ranks_per_worker_and_leave_out_what_is_not_live() {
        let s = slots(&[
            (7, 0, Some(10)),
            (7, 1, Some(10)),
            (3, 0, Some(9)),
            (4, 0, None),
        ]);
        let runs = [(0, 2, 3, 3), (1, 1, 1, 4), (2, 5, 5, 5), (3, 9, 9, 9)];
        let got = String::from_utf8(answer(&runs, &s, 4, 10)).unwrap();
        assert_eq!(
            got,
            concat!(
                r#"{"scores":{"7":{"0":8,"1":4}},"frequencies":[],"instances":{"#,
                r#""7":{"longest_matched":16,"gpu":8,"dp":{"0":8,"1":4},"cpu":12,"disk":16}}}"#
            )
        );
        let got = String::from_utf8(answer(&runs[2..], &s, 4, 9)).unwrap();
        assert!(got.starts_with(r#"{"scores":{"3":{"0":20}}"#), "{got}");
        assert_eq!(
            answer(&[], &s, 4, 0),
            br#"{"scores":{},"frequencies":[],"instances":{}}"#.to_vec()
        );
    }

    #[test]
    fn a_worker_with_no_gpu_match_is_an_instance_without_a_score() {
        let s = slots(&[(1, 0, Some(0))]);
        let got = String::from_utf8(answer(&[(0, 0, 2, 2)], &s, 16, 0)).unwrap();
        assert_eq!(
            got,
            concat!(
                r#"{"scores":{},"frequencies":[],"instances":{"1":{"longest_matched":32,"#,
                r#""gpu":0,"dp":{"0":0},"cpu":32,"disk":32}}}"#
            )
        );
    }

    #[test]
    fn slots_are_added_in_order() {
        let mut s = DynamoSlots::new();
        assert!(s.set_slot(1, 0, 0, None).is_err());
        assert!(s.set_seen(0, None).is_err());
    }
}
