use super::{parse, Point, Trigger};

#[test]
fn the_environment_variable_reads_points_and_triggers() {
    let (p, t) = parse("create,map@p=0.25@seed=9").unwrap();
    assert_eq!((p, t), (vec![Point::Create, Point::Map], Trigger::Random { probability: 0.25, seed: 9 }));
    let (p, t) = parse("all@nth=3").unwrap();
    assert_eq!((p.len(), t), (Point::ALL.len(), Trigger::Nth(3)));
    for bad in ["mapp", "map@p=2", "map@p=0.1@nth=2", "map@x=1", "map@nth"] {
        assert!(parse(bad).is_err(), "{bad}");
    }
}
