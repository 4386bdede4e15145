//! Avro's binary primitives: a bounds-checked reader and a growing writer (plain Rust; the
//! Python-facing coder is in `avro.rs`).

/// Why bytes do not decode (the message is the one the tests' oracle, tests/helpers/avro_strict.py,
/// gives too).
#[derive(Debug, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

pub struct Reader<'a> {
    data: &'a [u8],
    pub at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8], at: usize) -> Self {
        Reader { data, at }
    }

    pub fn left(&self) -> usize {
        self.data.len() - self.at
    }

    /// A zigzag varint of at most 10 bytes whose value fits 64 bits.
    pub fn long(&mut self) -> Result<i64, Malformed> {
        let mut acc: u64 = 0;
        let mut shift = 0u32;
        loop {
            let Some(&b) = self.data.get(self.at) else {
                return Err(Malformed("truncated varint"));
            };
            self.at += 1;
            if shift == 63 && b & 0x7e != 0 {
                return Err(Malformed("varint overflows 64 bits"));
            }
            acc |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                break;
            }
            shift += 7;
            if shift > 63 {
                return Err(Malformed("varint longer than 10 bytes"));
            }
        }
        Ok(((acc >> 1) as i64) ^ -((acc & 1) as i64))
    }

    pub fn byte(&mut self, what: &'static str) -> Result<u8, Malformed> {
        let b = *self.data.get(self.at).ok_or(Malformed(what))?;
        self.at += 1;
        Ok(b)
    }

    pub fn fixed<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], Malformed> {
        let end = self
            .at
            .checked_add(N)
            .filter(|&e| e <= self.data.len())
            .ok_or(Malformed(what))?;
        let mut out = [0u8; N];
        out.copy_from_slice(&self.data[self.at..end]);
        self.at = end;
        Ok(out)
    }

    /// A length-prefixed run of bytes (Avro's bytes and string).
    pub fn sized(&mut self) -> Result<&'a [u8], Malformed> {
        let n = self.long()?;
        if n < 0 {
            return Err(Malformed("negative length"));
        }
        if n as u64 > self.left() as u64 {
            return Err(Malformed("length past the end of the message"));
        }
        let start = self.at;
        self.at += n as usize;
        Ok(&self.data[start..self.at])
    }

    /// An array block's item count (0: the end); a count larger than the bytes left is
    /// refused before anything is allocated (every item takes at least one byte).
    pub fn block_count(&mut self) -> Result<usize, Malformed> {
        let mut count = self.long()?;
        if count < 0 {
            if count == i64::MIN {
                return Err(Malformed("array block count out of range"));
            }
            self.long()?; // the block's size in bytes: not needed
            count = -count;
        }
        if count as u64 > self.left() as u64 {
            return Err(Malformed("array longer than the message"));
        }
        Ok(count as usize)
    }
}

/// A zigzag varint.
pub fn put_long(out: &mut Vec<u8>, v: i64) {
    let mut u = ((v << 1) ^ (v >> 63)) as u64;
    while u >= 0x80 {
        out.push((u as u8) | 0x80);
        u >>= 7;
    }
    out.push(u as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long(bytes: &[u8]) -> Result<i64, Malformed> {
        Reader::new(bytes, 0).long()
    }

    #[test]
    fn varints_round_trip_at_every_width() {
        for v in [0, -1, 1, 63, -64, 64, i32::MAX as i64, i64::MIN, i64::MAX] {
            let mut out = Vec::new();
            put_long(&mut out, v);
            assert!(out.len() <= 10);
            let mut r = Reader::new(&out, 0);
            assert_eq!(r.long(), Ok(v));
            assert_eq!(r.at, out.len());
        }
    }

    #[test]
    fn malformed_varints_are_refused() {
        assert_eq!(long(b""), Err(Malformed("truncated varint")));
        assert_eq!(long(&[0x80]), Err(Malformed("truncated varint")));
        let mut eleven = vec![0x80u8; 10];
        eleven.push(0);
        assert_eq!(long(&eleven), Err(Malformed("varint longer than 10 bytes")));
        let mut past = vec![0xffu8; 9];
        past.push(0x7f);
        assert_eq!(long(&past), Err(Malformed("varint overflows 64 bits")));
    }

    #[test]
    fn lengths_and_counts_stay_inside_the_buffer() {
        assert_eq!(
            Reader::new(&[0x03], 0).sized(),
            Err(Malformed("negative length"))
        );
        assert_eq!(
            Reader::new(&[0x04, b'a'], 0).sized(),
            Err(Malformed("length past the end of the message"))
        );
        assert_eq!(
            Reader::new(&[0x80, 0x80, 0x80, 0x80, 0x08], 0).block_count(),
            Err(Malformed("array longer than the message"))
        );
        let min = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
        assert_eq!(
            Reader::new(&min, 0).block_count(),
            Err(Malformed("array block count out of range"))
        );
        let mut sized_block = Reader::new(&[0x03, 0x04, 0x04, 0x06, 0x00], 0);
        assert_eq!(sized_block.block_count(), Ok(2)); // -2 items, 2 bytes
    }
}
