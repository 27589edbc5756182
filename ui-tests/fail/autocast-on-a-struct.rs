use candle_amp::autocast;

#[autocast(fp16)]
struct Model;

fn main() {}
