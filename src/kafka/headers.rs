//! Record headers as Kafka has them: keys and values are any bytes.
//!
//! rdkafka's `Headers` API reads a key as `&str` and unwraps the UTF-8
//! conversion, so one record with a non-UTF-8 header key (Go and C
//! producers can send one) panicked the worker, and every member that took
//! the partition after it. Headers are read and written here through
//! librdkafka's C API instead, as bytes, without a panic path.
//!
//! One limit is librdkafka's own: its API hands a header name out as a
//! NUL-terminated string, so a name with a NUL byte in it is read up to
//! that byte. Headers never decide whether a trade is stored; the cut name
//! only shows in the copy a dead letter carries.

use std::ffi::CStr;
use std::os::raw::{c_char, c_void};
use std::ptr;

use rdkafka::bindings as rdsys;
use rdkafka::message::{BorrowedHeaders, Headers, OwnedHeaders};

/// One header: name and value (`None`: a null value, not an empty one).
pub type Header = (Vec<u8>, Option<Vec<u8>>);

/// The header list behind rdkafka's wrapper. `BorrowedHeaders` is that list
/// reinterpreted (rdkafka builds it by casting the pointer, and casts it back
/// the same way for its own calls); `header_bytes_round_trip` below fails
/// if a version of rdkafka ever changes that.
fn native(headers: &BorrowedHeaders) -> *mut rdsys::rd_kafka_headers_t {
    headers as *const BorrowedHeaders as *mut rdsys::rd_kafka_headers_t
}

/// Every header of a record, in order, as bytes.
pub fn read(headers: Option<&BorrowedHeaders>) -> Vec<Header> {
    let Some(headers) = headers else {
        return Vec::new();
    };
    (0..headers.count())
        .filter_map(|idx| read_one(headers, idx))
        .collect()
}

fn read_one(headers: &BorrowedHeaders, idx: usize) -> Option<Header> {
    let mut name: *const c_char = ptr::null();
    let mut value: *const c_void = ptr::null();
    let mut size: usize = 0;
    // SAFETY: `headers` is a live header list for the duration of the
    // call; librdkafka writes the three out-pointers, which then point into
    // that list (still alive while we copy them below).
    let err = unsafe {
        rdsys::rd_kafka_header_get_all(native(headers), idx, &mut name, &mut value, &mut size)
    };
    if err != rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
        return None;
    }
    // SAFETY: librdkafka returns a NUL-terminated name and, unless null,
    // `size` readable bytes of value.
    let name = unsafe { CStr::from_ptr(name) }.to_bytes().to_vec();
    let value = (!value.is_null())
        .then(|| unsafe { std::slice::from_raw_parts(value as *const u8, size) }.to_vec());
    Some((name, value))
}

/// Appends `name` (any bytes) with `value` to `headers`.
pub fn add(headers: &mut OwnedHeaders, name: &[u8], value: Option<&[u8]>) {
    let (value_ptr, value_len) = match value {
        Some(v) => (v.as_ptr() as *const c_void, v.len() as isize),
        None => (ptr::null(), 0),
    };
    // SAFETY: an `OwnedHeaders` is a writable list we own; librdkafka
    // copies `name_size` bytes of name and `value_len` of value.
    let err = unsafe {
        rdsys::rd_kafka_header_add(
            native(headers.as_borrowed()),
            name.as_ptr() as *const c_char,
            name.len() as isize,
            value_ptr,
            value_len,
        )
    };
    // librdkafka refuses an add only to a read-only list, which an
    // `OwnedHeaders` never is.
    debug_assert_eq!(err, rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_bytes_round_trip() {
        let mut h = OwnedHeaders::new();
        add(&mut h, b"plain", Some(b"v1"));
        add(&mut h, &[0xff, 0xfe, b'k'], Some(&[0x00, 0xc3]));
        add(&mut h, b"null-value", None);
        add(&mut h, b"", Some(b""));
        let read = read(Some(h.as_borrowed()));
        assert_eq!(
            read,
            vec![
                (b"plain".to_vec(), Some(b"v1".to_vec())),
                (vec![0xff, 0xfe, b'k'], Some(vec![0x00, 0xc3])),
                (b"null-value".to_vec(), None),
                (Vec::new(), Some(Vec::new())),
            ]
        );
    }

    #[test]
    fn a_nul_in_a_name_cuts_it_and_nothing_panics() {
        let mut h = OwnedHeaders::new();
        add(&mut h, b"ab\0cd", Some(b"v"));
        assert_eq!(
            read(Some(h.as_borrowed())),
            vec![(b"ab".to_vec(), Some(b"v".to_vec()))]
        );
    }
}
