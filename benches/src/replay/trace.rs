//! Production traces in Mooncake's FAST'25 format (`../shared/traces/`, read its README.md):
//! one JSON object a line, `timestamp` (ms since the trace's start), `input_length`,
//! `output_length` (tokens) and `hash_ids`, the request's 512-token blocks. Ids are chained: two
//! requests share a leading run of ids exactly when they share that prefix.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Tokens in one block of the trace.
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Milliseconds since the trace's first request.
    pub at_ms: u64,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Generated tokens.
    pub output_tokens: u32,
    /// The prompt's blocks in prefix order.
    pub blocks: Vec<u64>,
}

/// A trace that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file cannot be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// The trace file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a request in the expected format.
    #[error(
        "{path}:{line}: not a Mooncake trace request ({source}); expected one JSON object a line with timestamp, input_length, output_length and hash_ids"
    )]
    Format {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The parser's complaint.
        source: serde_json::Error,
    },
    /// A request's block list does not match its length.
    #[error(
        "{path}:{line}: {blocks} blocks for {tokens} input tokens (expected ceil(tokens / 512))"
    )]
    BlockCount {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Blocks listed.
        blocks: usize,
        /// Input tokens.
        tokens: u32,
    },
    /// The file holds no request.
    #[error("trace {0} holds no request")]
    Empty(PathBuf),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    timestamp: u64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// Reads a whole trace, at most `limit` requests (all when `None`), in file order.
pub fn load(path: &Path, limit: Option<usize>) -> Result<Vec<Request>, TraceError> {
    let io = |source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    };
    let reader = BufReader::new(File::open(path).map_err(io)?);
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(parse_line(path, i + 1, &line)?);
    }
    if out.is_empty() {
        return Err(TraceError::Empty(path.to_path_buf()));
    }
    let t0 = out.iter().map(|r| r.at_ms).min().unwrap_or(0);
    for r in &mut out {
        r.at_ms -= t0;
    }
    Ok(out)
}

fn parse_line(path: &Path, line: usize, text: &str) -> Result<Request, TraceError> {
    let l: Line = serde_json::from_str(text).map_err(|source| TraceError::Format {
        path: path.to_path_buf(),
        line,
        source,
    })?;
    if l.hash_ids.len() != l.input_length.div_ceil(TRACE_BLOCK_TOKENS) as usize {
        return Err(TraceError::BlockCount {
            path: path.to_path_buf(),
            line,
            blocks: l.hash_ids.len(),
            tokens: l.input_length,
        });
    }
    Ok(Request {
        at_ms: l.timestamp,
        input_tokens: l.input_length,
        output_tokens: l.output_length,
        blocks: l.hash_ids,
    })
}

/// Where the shared traces live: `$KVNODE_TRACES`, else `../shared/traces` beside the
/// repository, else `/work/shared/traces`. `None` when none of them exists.
pub fn traces_dir(repo_root: &Path) -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("KVNODE_TRACES").map(PathBuf::from),
        repo_root.parent().map(|p| p.join("shared/traces")),
        Some(PathBuf::from("/work/shared/traces")),
    ];
    candidates.into_iter().flatten().find(|p| p.is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(text: &str) -> Result<Request, TraceError> {
        parse_line(Path::new("t.jsonl"), 1, text)
    }

    #[test]
    fn a_request_line_parses() {
        let r = parse(
            r#"{"timestamp": 27, "input_length": 1025, "output_length": 3, "hash_ids": [1, 2, 3]}"#,
        )
        .unwrap();
        assert_eq!(r.blocks, vec![1, 2, 3]);
        assert_eq!((r.at_ms, r.input_tokens, r.output_tokens), (27, 1025, 3));
    }

    #[test]
    fn a_block_count_that_does_not_match_the_length_is_refused() {
        let e = parse(
            r#"{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1, 2]}"#,
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                TraceError::BlockCount {
                    blocks: 2,
                    tokens: 10,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_field_is_refused() {
        let e = parse(
            r#"{"timestamp": 0, "input_length": 1, "output_length": 3, "hash_ids": [1], "x": 1}"#,
        )
        .unwrap_err();
        assert!(matches!(e, TraceError::Format { .. }), "{e}");
    }

    proptest! {
        /// Arbitrary text never panics the parser; it parses or gives a typed error.
        #[test]
        fn arbitrary_lines_never_panic(text in ".{0,200}") {
            let _ = parse(&text);
        }
    }
}
