//! XXH3-128, the fast hash squishlike records beside SHA-256 for every file it writes (squishlike/io/checksum.py):
//! the first load checks it instead of SHA-256, which costs more than the dequantization it runs beside.

use xxhash_rust::xxh3::Xxh3Default;

/// A streaming XXH3-128 with the default seed and secret: the digest `xxh128sum` prints.
#[derive(Clone, Default)]
pub struct Xxh3_128(Xxh3Default);

impl Xxh3_128 {
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// The canonical form: 32 lowercase hex digits, the high 64 bits first.
    pub fn hexdigest(&self) -> String {
        format!("{:032x}", self.0.digest128())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(data: &[u8]) -> String {
        let mut h = Xxh3_128::default();
        h.update(data);
        h.hexdigest()
    }

    /// xxHash's sanity-test buffer: the top byte of a running product of its 64-bit prime.
    fn sanity_buffer(len: usize) -> Vec<u8> {
        let mut gen: u64 = 2654435761;
        (0..len)
            .map(|_| {
                let byte = (gen >> 56) as u8;
                gen = gen.wrapping_mul(11400714785074694797);
                byte
            })
            .collect()
    }

    #[test]
    fn known_vectors() {
        assert_eq!(hex(b""), "99aa06d3014798d86001c324468d497f");
        assert_eq!(hex(b"abc"), "06b05ab6733a618578af5f94892f3950");
        // One length per code path of the algorithm: short, mid-size, and the striped loop of long inputs.
        let buffer = sanity_buffer(4161);
        for (len, expected) in [
            (1, "a6cd5e9392000f6ac44bdff4074eecdb"),
            (17, "955fa78643ed3669abbc12d11973d7db"),
            (240, "aa4202daa2769dc85c9aae94c8ebe5a0"),
            (241, "99a80ecf0ecfc647c5a639ecd2030e5e"),
            (1000, "9b857abf662e5a25aca2dde0f1951b9a"),
            (4161, "06e30da044fbc01eefb6ccb06c0b206a"),
        ] {
            assert_eq!(hex(&buffer[..len]), expected, "length {len}");
        }
    }

    #[test]
    fn chunked_updates_equal_one_shot() {
        let data = sanity_buffer(100_000);
        let whole = hex(&data);
        for chunk in [1, 7, 64, 255, 256, 1024, 4099, 65536] {
            let mut h = Xxh3_128::default();
            data.chunks(chunk).for_each(|c| h.update(c));
            assert_eq!(h.hexdigest(), whole, "chunks of {chunk}");
        }
        let mut h = Xxh3_128::default();
        h.update(&[]); // an empty update changes nothing
        h.update(&data);
        assert_eq!(h.hexdigest(), whole);
    }

    #[test]
    fn different_data_differs() {
        let mut data = sanity_buffer(10_000);
        let before = hex(&data);
        data[5000] ^= 1;
        assert_ne!(hex(&data), before);
    }
}
