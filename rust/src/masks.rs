//! Holder masks: helpers of the router's groups (group.rs). A holder is a bit; a prompt's
//! positions each have a mask of the holders covering them, and a holder's run is the
//! longest stretch of positions 1, 2, ... it covers, found with one AND per position over
//! every holder still running.

/// The largest holder id plus one (as the pure twin's callers are held to).
pub const MAX_HOLDERS: usize = 1 << 20;

/// A hint that `item` is read soon: a lookup issues one per position before it reads any,
/// so that the cache misses of a whole prompt overlap.
#[inline(always)]
pub(crate) fn prefetch<T>(item: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it reads nothing and cannot fault.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((item as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = item;
}

/// (holder id, run length) for every holder covering position 1, from per-position masks
/// of `w` words each.
pub fn runs_of(masks: &[u64], w: usize) -> Vec<(usize, usize)> {
    let n = masks.len() / w;
    let mut out = Vec::new();
    if n == 0 {
        return out;
    }
    let mut alive = masks[..w].to_vec();
    let mut i = 1;
    while i < n && alive.iter().any(|&x| x != 0) {
        for k in 0..w {
            let still = alive[k] & masks[i * w + k];
            let mut gone = alive[k] & !still;
            while gone != 0 {
                out.push((k * 64 + gone.trailing_zeros() as usize, i));
                gone &= gone - 1;
            }
            alive[k] = still;
        }
        i += 1;
    }
    for (k, &word) in alive.iter().enumerate() {
        let mut left = word;
        while left != 0 {
            out.push((k * 64 + left.trailing_zeros() as usize, i));
            left &= left - 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_stop_where_each_holder_stops() {
        assert_eq!(
            runs_of(&[0b111, 0b101, 0b100, 0b110], 1),
            vec![(1, 1), (0, 2), (2, 4)]
        );
        assert!(runs_of(&[0, 1], 1).is_empty() && runs_of(&[], 1).is_empty());
    }

    #[test]
    fn holders_past_64_are_in_later_words() {
        // two words a position: holder 64 covers both positions, holder 0 the first
        assert_eq!(runs_of(&[1, 1, 0, 1], 2), vec![(0, 1), (64, 2)]);
    }
}
