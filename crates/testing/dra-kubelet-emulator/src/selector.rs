//! The CEL device selectors the allocator understands: a conjunction
//! (`&&`) of equalities, each `device.driver == '<name>'` or
//! `device.attributes['<domain>'].<name> == <value>` (a quoted string, an
//! integer or a boolean). An attribute of the driver's own domain is
//! published unqualified (`type`), another domain's qualified
//! (`resource.kubernetes.io/pcieRoot`), as resource.k8s.io/v1 says. Other
//! CEL is refused rather than guessed at.

use serde_json::Value;

/// One equality of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cond {
    Driver(String),
    Attribute {
        domain: String,
        name: String,
        value: Value,
    },
}

/// The conditions of `expr`, or None where it is outside the subset.
pub fn parse(expr: &str) -> Option<Vec<Cond>> {
    expr.split("&&").map(|c| cond(c.trim())).collect()
}

fn cond(c: &str) -> Option<Cond> {
    let (lhs, rhs) = c.split_once("==")?;
    let (lhs, rhs) = (lhs.trim(), rhs.trim());
    if lhs == "device.driver" {
        return Some(Cond::Driver(unquote(rhs)?.to_string()));
    }
    let rest = lhs.strip_prefix("device.attributes[")?;
    let (domain, name) = rest.split_once(']')?;
    let name = name.strip_prefix('.')?;
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return None;
    }
    let value = match unquote(rhs) {
        Some(s) => Value::from(s),
        None => match rhs {
            "true" => Value::from(true),
            "false" => Value::from(false),
            n => Value::from(n.parse::<i64>().ok()?),
        },
    };
    Some(Cond::Attribute {
        domain: unquote(domain.trim())?.to_string(),
        name: name.to_string(),
        value,
    })
}

fn unquote(s: &str) -> Option<&str> {
    ['\'', '"']
        .iter()
        .find_map(|q| s.strip_prefix(*q)?.strip_suffix(*q))
}

/// Whether device `d` of `driver` meets every condition (a missing
/// attribute meets none).
pub fn matches(conds: &[Cond], driver: &str, d: &Value) -> bool {
    conds.iter().all(|c| match c {
        Cond::Driver(want) => want == driver,
        Cond::Attribute {
            domain,
            name,
            value,
        } => {
            let key = if domain == driver {
                name.clone()
            } else {
                format!("{domain}/{name}")
            };
            let Some(a) = d.pointer("/attributes").and_then(|a| a.get(&key)) else {
                return false;
            };
            ["string", "int", "bool", "version"]
                .iter()
                .any(|k| a.get(*k) == Some(value))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_subset() {
        let c =
            parse("device.driver == 'd.io' && device.attributes['d.io'].profile == \"1g.10gb\"")
                .unwrap();
        let dev = |profile: &str| json!({"attributes": {"profile": {"string": profile}}});
        assert!(matches(&c, "d.io", &dev("1g.10gb")));
        assert!(!matches(&c, "d.io", &dev("3g.40gb")));
        assert!(!matches(&c, "e.io", &dev("1g.10gb")));
        let n = parse("device.attributes['d.io'].multiprocessors == 60").unwrap();
        assert!(matches(
            &n,
            "d.io",
            &json!({"attributes": {"multiprocessors": {"int": 60}}})
        ));
        assert!(!matches(&n, "d.io", &json!({"attributes": {}})));
        let q = parse("device.attributes['k.io'].root == 'a'").unwrap();
        assert!(matches(
            &q,
            "d.io",
            &json!({"attributes": {"k.io/root": {"string": "a"}}})
        ));
        assert_eq!(parse("device.capacity['d.io'].memory >= 1"), None);
        assert_eq!(parse("device.attributes['d.io'].type in ['a']"), None);
    }
}
