//! The default schema's common case read in one pass: a JSON object whose
//! members are plain (names and string values without escapes; numbers;
//! `true`, `false`, `null`; nothing nested), at most [`MAX_MEMBERS`] of
//! them, no name twice. Such an object comes back as (name, raw value)
//! pairs in input order, exactly the pairs `pointer::object` gives for it;
//! anything else (an escape, a control byte in a string, a nested value,
//! a syntax error, a duplicate name, more members) is `None`, and
//! `pointer::object` reads it, with its errors and their messages.
//!
//! Why by hand: serde_json's general reader captures each value raw (a
//! scan of its text) for the field parsers to read again, through its
//! generic visitor machinery, and that was about a fifth of the worker's
//! instructions per event (docs/benchmarks.md, "Session 30"). Every trade
//! an upstream serializer writes is such a flat object, so it is read
//! here with a byte scan and no allocation; the differential tests
//! (`event/tests/differential.rs`) hold it to serde_json's outcome.

use super::values::is_json_number;

/// Members read here; an object with more goes to serde_json (a trade has
/// eight fields, some upstreams a few extras).
pub(super) const MAX_MEMBERS: usize = 16;

/// The bytes a plain string goes on with: not its end (`"`), not an
/// escape (`\\`), not a control byte. A table, as serde_json reads them:
/// one load and one test per byte.
static PLAIN: [bool; 256] = {
    let mut table = [true; 256];
    let mut b = 0;
    while b < 0x20 {
        table[b] = false;
        b += 1;
    }
    table[b'"' as usize] = false;
    table[b'\\' as usize] = false;
    table
};

/// The bytes a JSON number can hold; `is_json_number` then checks their order.
static NUMERIC: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = b'0';
    while b <= b'9' {
        table[b as usize] = true;
        b += 1;
    }
    table[b'-' as usize] = true;
    table[b'+' as usize] = true;
    table[b'.' as usize] = true;
    table[b'e' as usize] = true;
    table[b'E' as usize] = true;
    table
};

/// An object's members as (name, raw JSON value), borrowed from the text.
pub(super) struct Flat<'a> {
    members: [(&'a str, &'a str); MAX_MEMBERS],
    len: usize,
}

impl<'a> Flat<'a> {
    pub(super) fn iter(&self) -> impl Iterator<Item = (&'a str, &'a str)> + '_ {
        self.members[..self.len].iter().copied()
    }
}

/// The members of `text` if it is a flat object as the module says.
pub(super) fn members(text: &str) -> Option<Flat<'_>> {
    let mut s = Scan { text, at: 0 };
    let mut out = Flat {
        members: [("", ""); MAX_MEMBERS],
        len: 0,
    };
    s.space();
    s.expect(b'{')?;
    s.space();
    if s.peek() == Some(b'}') {
        s.at += 1;
    } else {
        loop {
            let name = s.string()?;
            s.space();
            s.expect(b':')?;
            s.space();
            let value = s.value()?;
            let seen = &out.members[..out.len];
            if out.len == MAX_MEMBERS || seen.iter().any(|&(n, _)| n == name) {
                return None;
            }
            out.members[out.len] = (name, value);
            out.len += 1;
            s.space();
            match s.next()? {
                b',' => s.space(),
                b'}' => break,
                _ => return None,
            }
        }
    }
    s.space();
    (s.at == text.len()).then_some(out)
}

/// A position in the text. Every slice it hands out starts and ends next
/// to an ASCII byte, so it is on a character boundary of the `str`.
struct Scan<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.at += 1;
        Some(b)
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        (self.next()? == byte).then_some(())
    }

    /// JSON's whitespace, as serde_json skips it.
    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// A string without escapes or control bytes: its text between the
    /// quotes.
    fn string(&mut self) -> Option<&'a str> {
        self.expect(b'"')?;
        let start = self.at;
        let len = self.text.as_bytes()[start..]
            .iter()
            .position(|&b| !PLAIN[usize::from(b)])?;
        self.at = start + len;
        self.expect(b'"')?;
        Some(&self.text[start..start + len])
    }

    /// A scalar value's raw text: a plain string (quotes included), a
    /// number in JSON's grammar, or a literal. Objects and arrays are not
    /// read here.
    fn value(&mut self) -> Option<&'a str> {
        let start = self.at;
        match self.peek()? {
            b'"' => {
                self.string()?;
            }
            b'-' | b'0'..=b'9' => {
                let len = self.text.as_bytes()[start..]
                    .iter()
                    .position(|&b| !NUMERIC[usize::from(b)])
                    .unwrap_or(self.text.len() - start);
                self.at = start + len;
                if !is_json_number(&self.text[start..self.at]) {
                    return None;
                }
            }
            _ => {
                let rest = &self.text[start..];
                let literal = ["true", "false", "null"]
                    .into_iter()
                    .find(|l| rest.starts_with(l))?;
                self.at += literal.len();
            }
        }
        Some(&self.text[start..self.at])
    }
}
