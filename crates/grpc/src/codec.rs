//! The `weft.v1` services' protobuf codec: prost's, except that a message that
//! does not decode is the caller's error. tonic answers INTERNAL for it (as
//! gRPC's own libraries do), but in Weft's contract INTERNAL means an engine
//! failure; a body that is not a valid `weft.v1` message is INVALID_ARGUMENT
//! naming the message type, and the connection keeps serving. (Framing errors
//! below the codec keep tonic's codes: a message over the 4 MiB limit is
//! OUT_OF_RANGE, a bad compressed flag or a truncated frame INTERNAL.)

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, ProstCodec};
use tonic::Status;

/// `ProstCodec` with decode errors as INVALID_ARGUMENT (see the module docs).
#[derive(Debug, Clone)]
pub struct WeftCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for WeftCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for WeftCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <ProstCodec<T, U> as Codec>::Encoder;
    type Decoder = WeftDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        WeftDecoder(PhantomData)
    }
}

#[derive(Debug, Clone)]
pub struct WeftDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for WeftDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(decode_error::<U>)
    }
}

/// INVALID_ARGUMENT naming the message type that did not decode.
fn decode_error<U>(e: prost::DecodeError) -> Status {
    let name = std::any::type_name::<U>()
        .rsplit("::")
        .next()
        .unwrap_or("message");
    Status::invalid_argument(format!(
        "the request body is not a valid weft.v1.{name} protobuf message: {e}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;

    #[test]
    fn decode_errors_are_invalid_argument_naming_the_message() {
        // Field 2 (text, length-delimited) claiming 100 bytes, with 1 present.
        let e = pb::GenerateRequest::decode(&[0x12u8, 100, b'x'][..]).unwrap_err();
        let s = decode_error::<pb::GenerateRequest>(e);
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert!(
            s.message().contains("weft.v1.GenerateRequest"),
            "{}",
            s.message()
        );
    }
}
