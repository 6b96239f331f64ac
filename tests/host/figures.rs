//! The README's figures against their sources, so that a figure changed in
//! one place cannot stay stale in another.
//!
//! - Each row of a README table between `<!-- figures -->` and
//!   `<!-- /figures -->` is, word for word, a row of a table between
//!   `<!-- glance -->` and `<!-- /glance -->` in the file its last cell
//!   links to (`docs/results.md` or `docs/python.md`), the link rewritten
//!   from the README's folder; the link's anchor is a heading there.
//! - Every number in README prose between `<!-- figures: FILE -->` and
//!   `<!-- /figures -->` is a number of FILE's glance table.
//! - Every number of a glance row (but its link) is given in the section
//!   the row links to, where it was measured.

use std::path::Path;

/// A file of the repository.
fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The blocks between `<!-- NAME[: ARG] -->` and `<!-- /NAME -->`: (ARG,
/// the text between).
fn blocks<'a>(text: &'a str, name: &str) -> Vec<(&'a str, &'a str)> {
    let (open, close) = (format!("<!-- {name}"), format!("<!-- /{name} -->"));
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(&open) {
        let after = &rest[i + open.len()..];
        let end = after.find("-->").expect("a marker ends with -->");
        let arg = after[..end].trim().trim_start_matches(':').trim();
        let body = &after[end + 3..];
        let j = body.find(&close).unwrap_or_else(|| panic!("{open} without {close}"));
        out.push((arg, &body[..j]));
        rest = &body[j + close.len()..];
    }
    out
}

/// The body rows of the tables in `text` (no header, no separator row).
fn rows(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut header = true;
    for line in text.lines().map(str::trim) {
        if !line.starts_with('|') {
            header = true;
            continue;
        }
        let separator = line.chars().all(|c| matches!(c, '|' | '-' | ':' | ' '));
        if !header && !separator {
            out.push(line);
        }
        header = false;
    }
    out
}

/// A row's cells.
fn cells(row: &str) -> Vec<&str> {
    row.trim().trim_matches('|').split('|').map(str::trim).collect()
}

/// The numbers written in `text` (`1,607`, `1.004`, `25.7`), not those in
/// names (`H200`, `api2`).
fn numbers(text: &str) -> Vec<&str> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let glued = i > 0 && (b[i - 1].is_ascii_alphanumeric() || matches!(b[i - 1], b'_' | b'.' | b','));
        if !b[i].is_ascii_digit() || glued {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len()
            && (b[i].is_ascii_digit() || (matches!(b[i], b'.' | b',') && b.get(i + 1).is_some_and(u8::is_ascii_digit)))
        {
            i += 1;
        }
        // Digits glued to letters after them (`2x`, `4th`) name things.
        if !b.get(i).is_some_and(|c| c.is_ascii_alphabetic() || *c == b'_') {
            out.push(&text[start..i]);
        }
    }
    out
}

/// Whether `text` writes the number `n` (not as a part of another).
fn writes(text: &str, n: &str) -> bool {
    numbers(text).contains(&n)
}

/// GitHub's anchor of a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The section of `text` under the heading whose anchor is `anchor`, up
/// to the next heading of its level or above.
fn section<'a>(text: &'a str, anchor: &str) -> Option<&'a str> {
    let level = |l: &str| l.chars().take_while(|&c| c == '#').count();
    let mut offset = 0;
    let mut found: Option<(usize, usize)> = None;
    let mut fenced = false;
    for line in text.split_inclusive('\n') {
        fenced ^= line.starts_with("```");
        let l = level(line);
        if !fenced && l > 0 && line[l..].starts_with(' ') {
            match found {
                Some((start, lv)) if l <= lv => return Some(&text[start..offset]),
                None if slug(&line[l..]) == anchor => found = Some((offset, l)),
                _ => {}
            }
        }
        offset += line.len();
    }
    found.map(|(start, _)| &text[start..])
}

/// The link target of a row's last cell: (file under `docs/`, anchor).
fn link(cell: &str) -> Option<(&str, &str)> {
    let target = cell.split_once("](")?.1.split_once(')')?.0;
    let (file, anchor) = target.split_once('#')?;
    Some((file, anchor))
}

/// Everything wrong with `readme` against the sources (`read_source`
/// gives a file's text by its path from the repository's root).
fn problems(readme: &str, read_source: &dyn Fn(&str) -> String) -> Vec<String> {
    let mut out = Vec::new();
    let mut checked_rows = 0;
    for (arg, body) in blocks(readme, "figures") {
        if arg.is_empty() {
            for row in rows(body) {
                checked_rows += 1;
                let c = cells(row);
                let Some((file, anchor)) = c.last().and_then(|l| link(l)) else {
                    out.push(format!("README row links to no section: {row}"));
                    continue;
                };
                let Some(name) = file.strip_prefix("docs/") else {
                    out.push(format!("README row links outside docs/: {row}"));
                    continue;
                };
                let source = read_source(file);
                let glance: Vec<&str> = blocks(&source, "glance").iter().flat_map(|(_, b)| rows(b)).collect();
                let as_there = row.replace(&format!("]({file}#"), "](#");
                if !glance.contains(&as_there.as_str()) {
                    out.push(format!("README row is no glance row of {file} (stale on one side?): {row}"));
                }
                if section(&source, anchor).is_none() {
                    out.push(format!("README row links to {name}#{anchor}, no heading there"));
                }
            }
        } else {
            let source = read_source(arg);
            let glance: String = blocks(&source, "glance").iter().map(|(_, b)| *b).collect();
            if glance.is_empty() {
                out.push(format!("README prose names {arg}, which has no glance table"));
            }
            for n in numbers(body) {
                if !writes(&glance, n) {
                    out.push(format!("README prose figure {n} is not in {arg}'s glance table"));
                }
            }
        }
    }
    if checked_rows == 0 {
        out.push("README has no <!-- figures --> table".into());
    }
    out
}

/// Everything wrong with a source's glance rows: a number its section
/// does not give.
fn glance_problems(file: &str, source: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (_, body) in blocks(source, "glance") {
        for row in rows(body) {
            let c = cells(row);
            let Some((_, anchor)) = c.last().and_then(|l| link(l)) else {
                out.push(format!("{file}: glance row links to no section: {row}"));
                continue;
            };
            let Some(sec) = section(source, anchor) else {
                out.push(format!("{file}: glance row links to #{anchor}, no heading there"));
                continue;
            };
            for n in c[..c.len() - 1].iter().flat_map(|cell| numbers(cell)) {
                if !writes(sec, n) {
                    out.push(format!("{file}: glance figure {n} is not in section #{anchor}: {row}"));
                }
            }
        }
    }
    out
}

const SOURCES: [&str; 2] = ["docs/results.md", "docs/python.md"];

#[test]
fn readme_figures_are_rows_of_the_results_files() {
    let readme = read("README.md");
    let p = problems(&readme, &read);
    assert!(p.is_empty(), "README's figures and their sources disagree:\n{}", p.join("\n"));
}

#[test]
fn every_glance_figure_is_measured_in_its_section() {
    for file in SOURCES {
        let p = glance_problems(file, &read(file));
        assert!(p.is_empty(), "{}", p.join("\n"));
        assert!(!blocks(&read(file), "glance").is_empty(), "{file} has no glance table");
    }
}

/// The checks catch an edit: every number of the README's figures,
/// changed by one in its last digit in the README alone (or in its source
/// alone), is reported.
#[test]
fn a_figure_changed_in_one_place_fails() {
    let readme = read("README.md");
    let bump = |n: &str| {
        let last = n.chars().last().unwrap().to_digit(10).unwrap();
        format!("{}{}", &n[..n.len() - 1], (last + 1) % 10)
    };
    let mut tried = 0;
    for (_, body) in blocks(&readme, "figures") {
        for (i, n) in numbers(body).into_iter().enumerate() {
            // The README's text with only this occurrence changed.
            let start = body.as_ptr() as usize - readme.as_ptr() as usize;
            let at = start + nth_number_offset(body, i);
            let edited = format!("{}{}{}", &readme[..at], bump(n), &readme[at + n.len()..]);
            assert!(!problems(&edited, &read).is_empty(), "README figure {n} (number {i}) edited, and no check failed");
            tried += 1;
        }
    }
    assert!(tried >= 20, "only {tried} README figures");
    // A source's glance figure changed, its section and the README not:
    // the README row is stale; a glance figure its section does not give
    // (987.654) is reported too.
    for file in SOURCES {
        let source = read(file);
        let (_, body) = blocks(&source, "glance")[0];
        let n = numbers(body)[0];
        let at = body.as_ptr() as usize - source.as_ptr() as usize + nth_number_offset(body, 0);
        let edit = |to: &str| format!("{}{to}{}", &source[..at], &source[at + n.len()..]);
        let edited = edit(&bump(n));
        let readme_sees = |f: &str| if f == file { edited.clone() } else { read(f) };
        assert!(!problems(&readme, &readme_sees).is_empty(), "{file}: glance figure {n} edited, README not stale?");
        assert!(!glance_problems(file, &edit("987.654")).is_empty(), "{file}: a glance figure its section lacks");
    }
}

/// The byte offset in `text` of the `i`-th number [`numbers`] finds.
fn nth_number_offset(text: &str, i: usize) -> usize {
    let n = numbers(text)[i];
    n.as_ptr() as usize - text.as_ptr() as usize
}

#[test]
fn numbers_are_read_as_written() {
    assert_eq!(
        numbers("1.004–1.023, −5.6% and 2,010 on an H200 (issue 33), api2 4th"),
        ["1.004", "1.023", "5.6", "2,010", "33"]
    );
    assert!(writes("at 1.116.", "1.116") && !writes("1.1160", "1.116") && !writes("21.4", "1.4"));
    assert_eq!(
        slug("Fast at the floor: page moves and growth (issue 33)"),
        "fast-at-the-floor-page-moves-and-growth-issue-33"
    );
}
