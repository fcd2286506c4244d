use mlx_rs::{ops, Array};

#[test]
fn mlx_runs_on_this_machine() {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
    let b = ops::matmul(&a, &a).unwrap();
    assert_eq!(b.as_slice::<f32>(), &[7.0, 10.0, 15.0, 22.0]);
    let r = mlx_rs::random::normal::<f32>(&[4], None, None, None).unwrap();
    r.eval().unwrap();
}
