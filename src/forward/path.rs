//! The request target's path as routing matches it and the upstream gets it: dot segments (RFC 3986 §5.2.4) resolved,
//! their percent-encoded forms (`%2e`, `%2E`, `.%2e`…) with them, so that the path a route was picked by is the path
//! that is forwarded. A path that climbs above the root, a segment that a server splitting it differently would read as
//! a dot segment (`..%2f`, `..\`, `..;x`), and a target with a byte that is not ASCII are refused. It decodes nothing
//! but the dots it resolves, and resolves nothing in the query.

use http::uri::{PathAndQuery, Uri};

use crate::error::ProxyError;

/// Resolves the dot segments of `uri`'s path in place (left as it is, and not copied, when it has none), or
/// refuses the target.
///
/// Resolved rather than refused: browsers and most clients resolve them before they send a request, so what
/// arrives with them is rare, but a link or a tool that leaves them in is not an attack. Above the root there is
/// nothing to resolve to: `/../x` is refused rather than clamped to `/x`, which would serve a request that asks
/// for what no path names. A segment that holds a dot segment between `%2f`, `%5c`, `\` or `;` is refused: an
/// upstream that reads those as `/` (or, as servlet containers do, `;` as the start of a segment's parameters)
/// would resolve a segment floodgate kept; an encoded slash elsewhere (`a%2Fb`) goes on as it came.
pub fn resolve_dot_segments(uri: &mut Uri) -> Result<(), ProxyError> {
    let Some(target) = uri.path_and_query() else {
        return Ok(());
    };
    // A raw UTF-8 target reaches each upstream as whatever it decodes it as; RFC 3986 §2 wants it percent-encoded.
    if !target.as_str().is_ascii() {
        return Err(ProxyError::InvalidTarget("a byte that is not ASCII"));
    }
    let Some(resolved) = resolved(uri.path())? else {
        return Ok(());
    };
    let target = match uri.query() {
        Some(query) => format!("{resolved}?{query}"),
        None => resolved,
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(PathAndQuery::try_from(target).map_err(|_| UNREADABLE)?);
    *uri = Uri::from_parts(parts).map_err(|_| UNREADABLE)?;
    Ok(())
}

const UNREADABLE: ProxyError = ProxyError::InvalidTarget("a path that cannot be put back together");

/// `path` with its dot segments resolved; `None` when it has none (the common case, which allocates nothing).
fn resolved(path: &str) -> Result<Option<String>, ProxyError> {
    // The asterisk form and an absolute form's empty path have no segments.
    let Some(segments) = path.strip_prefix('/') else {
        return Ok(None);
    };
    let mut any = false;
    for segment in segments.split('/') {
        match dots(segment) {
            Some(_) => any = true,
            None if hides_dots(segment) => {
                return Err(ProxyError::InvalidTarget(
                    "a dot segment behind an encoded slash, a backslash or a `;`",
                ))
            }
            None => {}
        }
    }
    if !any {
        return Ok(None);
    }
    let mut kept: Vec<&str> = Vec::new();
    // A path that ends in a dot segment names a directory: `/a/b/..` is `/a/`.
    let mut directory = false;
    for segment in segments.split('/') {
        directory = match dots(segment) {
            Some(1) => true,
            Some(_) => {
                if kept.pop().is_none() {
                    return Err(ProxyError::InvalidTarget("a path that climbs above the root"));
                }
                true
            }
            None => {
                kept.push(segment);
                false
            }
        };
    }
    let mut resolved = String::with_capacity(path.len());
    for segment in &kept {
        resolved.push('/');
        resolved.push_str(segment);
    }
    if directory || kept.is_empty() {
        resolved.push('/');
    }
    Ok(Some(resolved))
}

/// How many dots `segment` is, when it is only one or two (`.`, `..`, each dot as it is or as `%2e`).
fn dots(segment: &str) -> Option<usize> {
    let mut rest = segment.as_bytes();
    let mut dots = 0;
    while !rest.is_empty() {
        rest = match rest.strip_prefix(b".") {
            Some(after) => after,
            None if rest.get(..3).is_some_and(|dot| dot.eq_ignore_ascii_case(b"%2e")) => rest.get(3..)?,
            None => return None,
        };
        dots += 1;
    }
    (1..=2).contains(&dots).then_some(dots)
}

/// Whether some part of `segment`, split where another server might split it, is a dot segment.
fn hides_dots(segment: &str) -> bool {
    let bytes = segment.as_bytes();
    // Nearly every segment has none of the separators: one look, no split.
    if !bytes.iter().any(|&b| matches!(b, b'%' | b'\\' | b';')) {
        return false;
    }
    let mut part_start = 0;
    let mut at = 0;
    while at < bytes.len() {
        let separator = match bytes.get(at..) {
            Some([b'\\' | b';', ..]) => 1,
            Some([b'%', b'2', b'f' | b'F', ..] | [b'%', b'5', b'c' | b'C', ..]) => 3,
            _ => 0,
        };
        if separator == 0 {
            at += 1;
            continue;
        }
        if segment.get(part_start..at).and_then(dots).is_some() {
            return true;
        }
        at += separator;
        part_start = at;
    }
    segment.get(part_start..).and_then(dots).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(target: &str) -> Result<String, ProxyError> {
        let mut uri: Uri = target.parse().unwrap();
        resolve_dot_segments(&mut uri).map(|()| uri.to_string())
    }

    #[test]
    fn dot_segments_resolve_as_rfc_3986_says_and_encoded_dots_are_dots() {
        for (target, resolved) in [
            ("/a/b/c/./../../g", "/a/g"),
            ("/a/./b/", "/a/b/"),
            ("/a/b/..", "/a/"),
            ("/a/b/.", "/a/b/"),
            ("/a/..", "/"),
            ("/./", "/"),
            ("/a//../b", "/a/b"),
            ("/a/%2e%2E/b?x=/../y", "/b?x=/../y"),
            ("/a/.%2e/b", "/b"),
            ("/a/%2E./b", "/b"),
            ("/a/%2e/b", "/a/b"),
            ("http://h.example/a/../b", "http://h.example/b"),
        ] {
            assert_eq!(resolve(target).unwrap(), resolved, "{target}");
        }
    }

    #[test]
    fn a_path_without_dot_segments_is_left_as_it_came() {
        for target in [
            "/",
            "/a.b/...c/.d/e.",
            "/.../x",
            "/a%2Fb/c",
            "/%2e%2e%2e/x",
            "/a;b=c/d",
            "*",
            "/x?q=../..",
        ] {
            assert_eq!(resolve(target).unwrap(), target, "{target}");
        }
    }

    #[test]
    fn climbing_above_the_root_hidden_dot_segments_and_non_ascii_bytes_are_refused() {
        for target in [
            "/..",
            "/../a",
            "/a/../..",
            "/%2e%2e/a",
            "/a/..%2fb",
            "/a/b%2F..",
            "/a/..%5Cb",
            "/a/..\\b",
            "/a/..;jsessionid=1/b",
            "/a/x;..",
            "/caf\u{e9}",
            "/a?q=\u{e9}",
        ] {
            let refused = resolve(target);
            assert!(
                matches!(refused, Err(ProxyError::InvalidTarget(_))),
                "{target}: {refused:?}"
            );
        }
    }
}
