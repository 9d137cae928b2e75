//! How an error is told in one line: its message and its chain of causes,
//! for the logs and the command line.

/// "outer: inner: innermost", for logs.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
