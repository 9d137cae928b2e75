//! The Confluent wire format's header: magic byte 0, the schema id as four
//! big-endian bytes, and for Protobuf the message indexes (which message
//! of the schema's file the payload is) as zig-zag varints: a count, then
//! that many indexes, with a lone 0 standing for `[0]`, the first message.
//! Pure, and total: any bytes give a header or a typed error, never a panic.

/// A schema's id in the registry.
pub type SchemaId = u32;

/// Why a payload's header could not be read (dead-lettered as
/// `invalid_format`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("payload is {0} bytes, shorter than the 5-byte Confluent header")]
    Truncated(usize),
    #[error("first byte is {0:#04x}, not the Confluent magic byte 0")]
    NoMagicByte(u8),
    #[error("the Protobuf message indexes are truncated or malformed")]
    BadIndexes,
    #[error("the Protobuf message indexes are not valid ({0})")]
    InvalidIndex(String),
}

/// Most message indexes accepted: nesting deeper than this is no real
/// schema, and the bound keeps a hostile count from allocating.
pub const MAX_INDEXES: usize = 64;

/// The schema id and the datum after the 5-byte header.
pub fn split(payload: &[u8]) -> Result<(SchemaId, &[u8]), HeaderError> {
    match payload {
        [0, a, b, c, d, rest @ ..] => Ok((u32::from_be_bytes([*a, *b, *c, *d]), rest)),
        [m, ..] if *m != 0 => Err(HeaderError::NoMagicByte(*m)),
        _ => Err(HeaderError::Truncated(payload.len())),
    }
}

/// The Protobuf message indexes at the start of `data`, and the message
/// after them.
pub fn message_indexes(data: &[u8]) -> Result<(Vec<usize>, &[u8]), HeaderError> {
    let (count, mut rest) = zigzag(data)?;
    if count == 0 {
        // The common case, written as one byte: the file's first message.
        return Ok((vec![0], rest));
    }
    if count < 0 || count as usize > MAX_INDEXES {
        return Err(HeaderError::InvalidIndex(format!("count {count}")));
    }
    let mut indexes = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let (index, after) = zigzag(rest)?;
        let index = usize::try_from(index)
            .map_err(|_| HeaderError::InvalidIndex(format!("index {index}")))?;
        indexes.push(index);
        rest = after;
    }
    Ok((indexes, rest))
}

/// One zig-zag varint (at most 10 bytes, as for an i64).
fn zigzag(data: &[u8]) -> Result<(i64, &[u8]), HeaderError> {
    let mut value: u64 = 0;
    for (i, &b) in data.iter().enumerate().take(10) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            let signed = (value >> 1) as i64 ^ -((value & 1) as i64);
            return Ok((signed, &data[i + 1..]));
        }
    }
    Err(HeaderError::BadIndexes)
}

/// The header as producers write it, for tests and `map --sample`.
pub fn header(id: SchemaId) -> [u8; 5] {
    let b = id.to_be_bytes();
    [0, b[0], b[1], b[2], b[3]]
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn zigzag_bytes(v: i64) -> Vec<u8> {
        let mut u = ((v << 1) ^ (v >> 63)) as u64;
        let mut out = Vec::new();
        loop {
            let b = (u & 0x7f) as u8;
            u >>= 7;
            if u == 0 {
                out.push(b);
                return out;
            }
            out.push(b | 0x80);
        }
    }

    #[test]
    fn a_header_gives_its_id_and_the_rest() {
        let mut p = header(0x0102_0304).to_vec();
        p.extend_from_slice(b"xyz");
        assert_eq!(split(&p), Ok((0x0102_0304, &b"xyz"[..])));
        assert_eq!(split(&[0, 0, 0, 0, 7]), Ok((7, &[][..])));
    }

    #[test]
    fn no_magic_byte_or_a_short_header_is_refused() {
        assert_eq!(split(b"{\"a\":1}"), Err(HeaderError::NoMagicByte(b'{')));
        assert_eq!(split(&[]), Err(HeaderError::Truncated(0)));
        assert_eq!(split(&[0, 0, 1]), Err(HeaderError::Truncated(3)));
        assert_eq!(split(&[1, 0, 0, 0, 1]), Err(HeaderError::NoMagicByte(1)));
    }

    #[test]
    fn message_indexes_as_confluent_writes_them() {
        assert_eq!(message_indexes(&[0, 9]), Ok((vec![0], &[9][..])));
        let mut p = zigzag_bytes(2);
        p.extend(zigzag_bytes(1));
        p.extend(zigzag_bytes(300));
        p.push(0xAA);
        assert_eq!(message_indexes(&p), Ok((vec![1, 300], &[0xAA][..])));
        assert_eq!(message_indexes(&[]), Err(HeaderError::BadIndexes));
        assert_eq!(message_indexes(&[0x80]), Err(HeaderError::BadIndexes));
        assert!(message_indexes(&zigzag_bytes(-1)).is_err());
        assert!(message_indexes(&zigzag_bytes(1000)).is_err());
    }

    proptest! {
        #[test]
        fn any_bytes_give_a_header_or_an_error(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok((id, rest)) = split(&bytes) {
                prop_assert_eq!(&header(id)[..], &bytes[..5]);
                prop_assert_eq!(rest, &bytes[5..]);
                let _ = message_indexes(rest);
            }
        }

        #[test]
        fn indexes_round_trip(indexes in proptest::collection::vec(0i64..100_000, 1..8), tail in proptest::collection::vec(any::<u8>(), 0..8)) {
            let mut p = zigzag_bytes(indexes.len() as i64);
            for i in &indexes {
                p.extend(zigzag_bytes(*i));
            }
            p.extend(&tail);
            let (got, rest) = message_indexes(&p).unwrap();
            prop_assert_eq!(got, indexes.iter().map(|&i| i as usize).collect::<Vec<_>>());
            prop_assert_eq!(rest, &tail[..]);
        }
    }
}
