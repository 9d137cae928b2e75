//! A small BSON writer for the store's fixed shapes (the fill statement, a
//! new bucket, the `update` command): every element written in place into
//! one buffer sized up front. `rawdoc!` instead builds each nested value in
//! its own buffer, copies it into its parent's, and grows every buffer as
//! it goes; for a fill statement that was most of the encoding's cost.
//!
//! The bytes are those bson 2.15's `RawDocumentBuf::append` writes (element
//! type, name, NUL, value; a document's length patched in at its end): the
//! codec's property tests hold the two to each other.
//!
//! Names are the caller's to keep free of NUL: BSON names are NUL-ended,
//! so one with a NUL would end early and leave the rest of the name to be
//! read as the value. The codec's names are its own literals, array
//! indices and watermark keys (see `codec::nameable`).

use mongodb::bson::{RawDocument, RawDocumentBuf};

/// BSON element types we write.
pub(super) const STRING: u8 = 0x02;
pub(super) const DOCUMENT: u8 = 0x03;
pub(super) const ARRAY: u8 = 0x04;
pub(super) const BOOLEAN: u8 = 0x08;
pub(super) const INT32: u8 = 0x10;
pub(super) const INT64: u8 = 0x12;

/// An element's name.
#[derive(Clone, Copy)]
pub(super) enum Name<'a> {
    Field(&'a str),
    /// An array element's: its index in decimal, written without a
    /// `String` (bson's `RawArrayBuf::push` makes one per element).
    Index(usize),
    /// Two parts written one after the other (`wm.` and a watermark key),
    /// so the caller need not build the name.
    Joined(&'static str, &'a str),
}

impl<'a> From<&'a str> for Name<'a> {
    fn from(name: &'a str) -> Self {
        Name::Field(name)
    }
}

impl From<usize> for Name<'_> {
    fn from(index: usize) -> Self {
        Name::Index(index)
    }
}

impl Name<'_> {
    /// Its length in bytes, without the NUL.
    pub(super) fn len(self) -> usize {
        match self {
            Name::Field(name) => name.len(),
            Name::Index(i) => digits(i),
            Name::Joined(a, b) => a.len() + b.len(),
        }
    }
}

/// Decimal digits of `i`.
pub(super) fn digits(i: usize) -> usize {
    i.checked_ilog10().map_or(1, |d| d as usize + 1)
}

/// Bytes of an element with `name` and a value of `value` bytes: type,
/// name, NUL, value.
pub(super) fn element<'a>(name: impl Into<Name<'a>>, value: usize) -> usize {
    2 + name.into().len() + value
}

/// Bytes of a string value: length, bytes, NUL.
pub(super) fn string(s: &str) -> usize {
    4 + s.len() + 1
}

/// Bytes of a document (or an array) whose elements take `content` bytes:
/// length, elements, NUL.
pub(super) fn document(content: usize) -> usize {
    4 + content + 1
}

/// Bytes of an array whose elements' values take the given sizes.
pub(super) fn array(values: impl Iterator<Item = usize>) -> usize {
    document(values.enumerate().map(|(i, v)| element(i, v)).sum())
}

/// A document (or array) begun and not yet ended: where its length goes.
#[must_use = "a document must be ended"]
pub(super) struct Open(usize);

/// One buffer of BSON being written.
pub(super) struct BsonOut {
    buf: Vec<u8>,
    /// The size the caller computed, which the writing must meet exactly:
    /// more would `realloc`, less would hold memory for nothing; either
    /// means a size function out of step with its writer.
    #[cfg(debug_assertions)]
    planned: usize,
}

impl BsonOut {
    /// A writer whose buffer holds `size` bytes, the document's exact size.
    pub(super) fn with_capacity(size: usize) -> Self {
        BsonOut {
            buf: Vec::with_capacity(size),
            #[cfg(debug_assertions)]
            planned: size,
        }
    }

    /// Begins a document (the top one, or an element's value).
    pub(super) fn begin(&mut self) -> Open {
        let at = self.buf.len();
        self.buf.extend_from_slice(&[0; 4]);
        Open(at)
    }

    /// Ends a document: its NUL, and its length (as bson does, `as i32`).
    pub(super) fn end(&mut self, open: Open) {
        self.buf.push(0);
        let len = (self.buf.len() - open.0) as i32;
        self.buf[open.0..open.0 + 4].copy_from_slice(&len.to_le_bytes());
    }

    /// An element's type and name.
    fn name<'a>(&mut self, kind: u8, name: impl Into<Name<'a>>) {
        self.buf.push(kind);
        match name.into() {
            Name::Field(name) => self.buf.extend_from_slice(name.as_bytes()),
            Name::Index(i) => self.index(i),
            Name::Joined(a, b) => {
                self.buf.extend_from_slice(a.as_bytes());
                self.buf.extend_from_slice(b.as_bytes());
            }
        }
        self.buf.push(0);
    }

    /// `i` in decimal, through a stack buffer (a `usize` has at most 20).
    fn index(&mut self, mut i: usize) {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        loop {
            at -= 1;
            digits[at] = b'0' + (i % 10) as u8;
            i /= 10;
            if i == 0 {
                break;
            }
        }
        self.buf.extend_from_slice(&digits[at..]);
    }

    /// An embedded document element; end it with [`BsonOut::end`].
    pub(super) fn document<'a>(&mut self, name: impl Into<Name<'a>>) -> Open {
        self.name(DOCUMENT, name);
        self.begin()
    }

    /// An array element; end it with [`BsonOut::end`].
    pub(super) fn array<'a>(&mut self, name: impl Into<Name<'a>>) -> Open {
        self.name(ARRAY, name);
        self.begin()
    }

    /// An embedded document element holding `doc`'s bytes as they are.
    pub(super) fn raw_document<'a>(&mut self, name: impl Into<Name<'a>>, doc: &RawDocument) {
        self.name(DOCUMENT, name);
        self.buf.extend_from_slice(doc.as_bytes());
    }

    pub(super) fn int64<'a>(&mut self, name: impl Into<Name<'a>>, v: i64) {
        self.name(INT64, name);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn int32<'a>(&mut self, name: impl Into<Name<'a>>, v: i32) {
        self.name(INT32, name);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub(super) fn boolean<'a>(&mut self, name: impl Into<Name<'a>>, v: bool) {
        self.name(BOOLEAN, name);
        self.buf.push(u8::from(v));
    }

    /// A string element: its length with the NUL (as bson does, `as i32`),
    /// its bytes (a NUL among them is fine: the length delimits it), NUL.
    pub(super) fn string<'a>(&mut self, name: impl Into<Name<'a>>, s: &str) {
        self.name(STRING, name);
        self.buf
            .extend_from_slice(&(s.len() as i32).wrapping_add(1).to_le_bytes());
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
    }

    /// A whole element (type, name, value) already encoded.
    pub(super) fn element_bytes(&mut self, element: &[u8]) {
        self.buf.extend_from_slice(element);
    }

    /// The document written, whose [`begin`](BsonOut::begin) came first
    /// and whose [`end`](BsonOut::end) came last.
    pub(super) fn finish(self) -> RawDocumentBuf {
        #[cfg(debug_assertions)]
        debug_assert_eq!(self.buf.len(), self.planned, "bytes written, bytes planned");
        // `from_bytes` checks only the length prefix and the final NUL,
        // which `end` wrote; the length fits an i32 because a document of
        // ours is at most a bucket's worth of trades (`capBytes`, under
        // MongoDB's 16 MiB) or an `update` command cut at the store's
        // statement budget plus one statement, far below 2 GiB.
        RawDocumentBuf::from_bytes(self.buf).expect("a whole document, under 2 GiB")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::rawdoc;

    #[test]
    fn indices_are_written_in_decimal_and_counted_alike() {
        for i in [0, 1, 9, 10, 99, 100, 12_345, usize::MAX] {
            let mut out = BsonOut::with_capacity(document(element(i, 4)));
            let open = out.begin();
            out.int32(i, 7);
            out.end(open);
            let d = out.finish();
            let mut expected = RawDocumentBuf::new();
            expected.append(i.to_string(), 7);
            assert_eq!(d.as_bytes(), expected.as_bytes(), "{i}");
            assert_eq!(digits(i), i.to_string().len());
        }
    }

    #[test]
    fn every_kind_is_written_as_bson_writes_it() {
        let entry = rawdoc! {"k": "v"};
        let expected = rawdoc! {
            "s": "a\0b", "wm.t~x:3": -5_i64, "f": false, "a": [{"k": "v"}], "d": {},
        };
        let mut out = BsonOut::with_capacity(expected.as_bytes().len());
        let open = out.begin();
        out.string("s", "a\0b");
        out.int64(Name::Joined("wm.", "t~x:3"), -5);
        out.boolean("f", false);
        let inner = out.array("a");
        out.raw_document(0, &entry);
        out.end(inner);
        let inner = out.document("d");
        out.end(inner);
        out.end(open);
        assert_eq!(out.finish().as_bytes(), expected.as_bytes());
    }
}
