//! Kubernetes quantities as this driver meets them in consumed capacity:
//! plain integers, binary (`Ki`..`Ei`) and decimal (`k`..`E`) suffixes,
//! exponents (`1e3`). Fractions and milli-units are refused: cores and
//! bytes are whole.

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "quantity {0:?} is not a whole number with an optional Ki/Mi/Gi/Ti/k/M/G/T suffix or exponent"
)]
pub struct BadQuantity(pub String);

/// A whole quantity (`gpu_pods::integer_quantity`: the one reader of
/// every form the API server writes).
pub fn parse(q: &str) -> Result<u64, BadQuantity> {
    gpu_pods::integer_quantity(q).ok_or_else(|| BadQuantity(q.to_string()))
}

/// Bytes as the API server would print them: the largest binary suffix
/// that divides exactly.
pub fn bytes(b: u64) -> String {
    for (suffix, shift) in [("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)] {
        if b != 0 && b.is_multiple_of(1u64 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms() {
        assert_eq!(parse("30"), Ok(30));
        assert_eq!(parse("1Gi"), Ok(1 << 30));
        assert_eq!(parse("1024Mi"), Ok(1 << 30));
        assert_eq!(parse("2G"), Ok(2_000_000_000));
        for bad in ["", "1.5Gi", "500m", "-1", "1Xi", "99999999999999999999Ei"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert_eq!(bytes(1 << 30), "1Gi");
        assert_eq!(bytes(15 << 30 | 512 << 20), "15872Mi");
        assert_eq!(bytes(1000), "1000");
        assert_eq!(parse(&bytes(16 << 30)), Ok(16 << 30));
    }
}
