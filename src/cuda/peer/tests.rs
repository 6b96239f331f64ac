use super::{newly_active, parse_map_peers, MapPeers};

#[test]
fn cumem_map_peers_picks_active_all_or_off() {
    assert_eq!(parse_map_peers(None), Ok(MapPeers::Active));
    for active in ["", "active", "1", "on", " Active "] {
        assert_eq!(parse_map_peers(Some(active)), Ok(MapPeers::Active), "{active}");
    }
    assert_eq!(parse_map_peers(Some("all")), Ok(MapPeers::All));
    for off in ["0", "false", "no", "off", " 0 ", "none"] {
        assert_eq!(parse_map_peers(Some(off)), Ok(MapPeers::Off), "{off}");
    }
    let e = parse_map_peers(Some("sometimes")).unwrap_err();
    assert!(e.contains("active, all, off"), "{e}");
}

#[test]
fn only_followers_not_seen_are_asked_about() {
    let mut asked = Vec::new();
    // All seen: nothing asked, nothing found.
    assert_eq!(
        newly_active(0b110, 0b110, |d| {
            asked.push(d);
            true
        }),
        0
    );
    assert!(asked.is_empty());
    // Device 1 seen, 2 and 5 not: only they are asked; 5 is active.
    let found = newly_active(0b100110, 0b10, |d| {
        asked.push(d);
        d == 5
    });
    assert_eq!(asked, [2, 5]);
    assert_eq!(found, 1 << 5);
    // Seen devices that are not followers are never asked about.
    asked.clear();
    assert_eq!(
        newly_active(0, u64::MAX, |d| {
            asked.push(d);
            true
        }),
        0
    );
    assert!(asked.is_empty());
}
