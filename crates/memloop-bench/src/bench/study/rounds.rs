//! Repeated rounds: the whole study runs `--repeat` times, experiment after experiment, so the
//! rounds of one figure are minutes apart (a noisy neighbour hits one round, not all). Each
//! figure is then the median of its rounds, with the spread kept in results.json.

use super::Rec;

/// What identifies one figure across rounds.
fn key(r: &Rec) -> (u32, &str, &str, u64, &str, Option<&str>) {
    (
        r.experiment,
        &r.test,
        &r.path,
        r.size,
        &r.unit,
        r.variant.as_deref(),
    )
}

/// The median of `v` (mean of the middle two for an even count); `None` when empty.
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

/// One record per figure, in first-seen order: the median value (and % change) of its rounds.
/// With more than one round, `rounds`, `min` and `max` say how many rounds measured it and how
/// far they spread; a figure some rounds missed keeps the rounds that have it.
pub fn merge(rounds: &[Vec<Rec>]) -> Vec<Rec> {
    let mut order: Vec<Rec> = Vec::new();
    let mut groups: Vec<Vec<&Rec>> = Vec::new();
    for r in rounds.iter().flatten() {
        match order.iter().position(|o| key(o) == key(r)) {
            Some(i) => groups[i].push(r),
            None => {
                order.push(r.clone());
                groups.push(vec![r]);
            }
        }
    }
    order
        .into_iter()
        .zip(groups)
        .map(|(mut out, g)| {
            let values: Vec<f64> = g.iter().map(|r| r.value).collect();
            out.value = median(values.clone()).unwrap_or(out.value);
            out.change_pct = median(g.iter().filter_map(|r| r.change_pct).collect());
            if rounds.len() > 1 {
                out.rounds = Some(g.len() as u32);
                out.min = values.iter().copied().reduce(f64::min);
                out.max = values.iter().copied().reduce(f64::max);
            }
            out
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(path: &str, v: f64) -> Rec {
        Rec::new(1, "rr", path, 64, "transactions/s", v)
    }

    #[test]
    fn medians_per_figure_in_first_seen_order() {
        let rounds = vec![
            vec![rec("memloop", 3.0), rec("veth", 10.0)],
            vec![rec("memloop", 1.0), rec("veth", 30.0)],
            vec![rec("veth", 20.0), rec("memloop", 2.0)],
        ];
        let m = merge(&rounds);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].path.as_str(), m[0].value), ("memloop", 2.0));
        assert_eq!((m[1].path.as_str(), m[1].value), ("veth", 20.0));
        assert_eq!(
            (m[1].rounds, m[1].min, m[1].max),
            (Some(3), Some(10.0), Some(30.0))
        );
    }

    #[test]
    fn variants_are_separate_figures_and_single_rounds_stay_plain() {
        let a = rec("memloop", 1.0).variant("same core");
        let b = rec("memloop", 5.0).variant("separate cores");
        let m = merge(&[vec![a, b]]);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].rounds, None);
        assert_eq!(median(vec![4.0, 1.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
    }
}
