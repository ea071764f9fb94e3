//! Key-to-shard hashing.
//!
//! The hash is **32-bit FNV-1a** over the UTF-8 bytes of the event's shard key
//! (its `key`, or its id in canonical text form when it has no key):
//! offset basis `0x811c9dc5`, prime `0x01000193`, for each byte
//! `h ^= byte; h = h.wrapping_mul(prime)`. The shard is `hash % total`.
//! Stores keep the hash in a column at insert time so the claim query can
//! filter `key_hash % total = index` in SQL. The algorithm is pinned by test
//! vectors below: changing it would move keys between relays.
//!
//! [`fnv1a_64`], the 64-bit variant, is the store crates' checksum (of
//! migrations, of long names); it is here beside its 32-bit sibling.

use thiserror::Error;

const FNV_OFFSET: u32 = 0x811c_9dc5;
const FNV_PRIME: u32 = 0x0100_0193;
const FNV64_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV64_PRIME: u64 = 0x0000_0100_0000_01b3;

/// 32-bit FNV-1a hash of a shard key. Stable forever; see the module docs.
pub fn key_hash(key: &[u8]) -> u32 {
    key.iter().fold(FNV_OFFSET, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(FNV_PRIME)
    })
}

/// 64-bit FNV-1a hash of `bytes` (offset basis `0xcbf29ce484222325`, prime
/// `0x100000001b3`). The store crates' one checksum: of a migration's SQL
/// (recorded in their history tables, so an edited migration is noticed)
/// and of a name too long to use as it is. It detects changes, it is not
/// meant to resist forgery; it never decides a shard (that is [`key_hash`]).
/// Stable forever: recorded checksums depend on it.
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV64_OFFSET, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(FNV64_PRIME)
    })
}

/// The shard (in `0..total`) that owns `key`. `total` of 0 is treated as 1.
pub fn shard_of(key: &[u8], total: u32) -> u32 {
    key_hash(key) % total.max(1)
}

/// This relay instance is shard `index` of `total`: it claims only events whose
/// key hashes to `index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "RawShardSpec")]
pub struct ShardSpec {
    index: u32,
    total: u32,
}

#[derive(serde::Deserialize)]
struct RawShardSpec {
    index: u32,
    total: u32,
}

impl TryFrom<RawShardSpec> for ShardSpec {
    type Error = InvalidShardSpec;
    fn try_from(raw: RawShardSpec) -> Result<Self, Self::Error> {
        ShardSpec::new(raw.index, raw.total)
    }
}

/// A [`ShardSpec`] that cannot exist.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum InvalidShardSpec {
    /// `total` was 0.
    #[error("shard total must be at least 1 (got 0)")]
    ZeroTotal,
    /// `index` was not below `total`.
    #[error("shard index {index} must be below shard total {total}")]
    IndexOutOfRange {
        /// The index given.
        index: u32,
        /// The total given.
        total: u32,
    },
    /// The text form was not `INDEX/TOTAL`.
    #[error("shard spec {0:?} is not of the form INDEX/TOTAL, e.g. 0/4")]
    Syntax(String),
}

impl ShardSpec {
    /// The single shard that owns every key.
    pub const ALL: ShardSpec = ShardSpec { index: 0, total: 1 };

    /// Shard `index` of `total`. Errors when `total == 0` or `index >= total`.
    pub fn new(index: u32, total: u32) -> Result<Self, InvalidShardSpec> {
        if total == 0 {
            return Err(InvalidShardSpec::ZeroTotal);
        }
        if index >= total {
            return Err(InvalidShardSpec::IndexOutOfRange { index, total });
        }
        Ok(Self { index, total })
    }

    /// This instance's shard index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The number of shards.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// Whether this shard owns `key`.
    pub fn owns(&self, key: &[u8]) -> bool {
        shard_of(key, self.total) == self.index
    }
}

impl Default for ShardSpec {
    fn default() -> Self {
        Self::ALL
    }
}

impl std::fmt::Display for ShardSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.total)
    }
}

impl std::str::FromStr for ShardSpec {
    type Err = InvalidShardSpec;
    /// Parses `INDEX/TOTAL`, e.g. `2/4`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (i, t) = s
            .split_once('/')
            .ok_or_else(|| InvalidShardSpec::Syntax(s.to_owned()))?;
        let index = i
            .trim()
            .parse()
            .map_err(|_| InvalidShardSpec::Syntax(s.to_owned()))?;
        let total = t
            .trim()
            .parse()
            .map_err(|_| InvalidShardSpec::Syntax(s.to_owned()))?;
        Self::new(index, total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_test_vectors_are_pinned() {
        // Reference values of 32-bit FNV-1a (also published by the FNV authors).
        assert_eq!(key_hash(b""), 0x811c_9dc5);
        assert_eq!(key_hash(b"a"), 0xe40c_292c);
        assert_eq!(key_hash(b"foobar"), 0xbf9c_f968);
        // Our own pinned vectors: changing any of these moves keys between shards.
        assert_eq!(key_hash(b"order-42"), 0x5724_46f4);
        assert_eq!(shard_of(b"order-42", 4), 0x5724_46f4 % 4);
        assert_eq!(shard_of(b"customer-7", 8), key_hash(b"customer-7") % 8);
    }

    #[test]
    fn fnv1a_64_test_vectors_are_pinned() {
        // Reference values of 64-bit FNV-1a (also published by the FNV authors).
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn spec_validation() {
        assert_eq!(ShardSpec::new(0, 0), Err(InvalidShardSpec::ZeroTotal));
        assert_eq!(
            ShardSpec::new(4, 4),
            Err(InvalidShardSpec::IndexOutOfRange { index: 4, total: 4 })
        );
        assert_eq!("2/4".parse::<ShardSpec>(), ShardSpec::new(2, 4));
        assert!("2-4".parse::<ShardSpec>().is_err());
        assert!("4/4".parse::<ShardSpec>().is_err());
    }

    #[test]
    fn every_key_has_exactly_one_owner() {
        for k in 0..1000 {
            let key = format!("key-{k}");
            let owners = (0..5)
                .filter(|i| ShardSpec::new(*i, 5).unwrap().owns(key.as_bytes()))
                .count();
            assert_eq!(owners, 1);
        }
    }
}
